"""A BPE without some single-byte tokens (SmolLM2's layout): bytes dropped as HF drops them.

The reference is HF `tokenizers` on a BPE it trains here with SmolLM2's pre-tokenizer and an
alphabet lacking SmolLM2's 21 missing bytes; offsets and loss masks are checked against what the
text itself says (the kept bytes, the assistant's text).
"""

import os
import random

import pytest
import tiktoken

from test_data_tokenizer_digits import DIGIT_CORPUS, FUZZ_ALPHABET, fuzz_texts, train_bpe
from test_data_tokenizer_hf import CORPUS, _write_ranks, hf_ids, tiny_json, write_json
from titan_draft.data.chat.template import render_chat
from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer
from titan_draft.data.tokenizer import Tokenizer, build_tokenizer

tokenizers = pytest.importorskip("tokenizers")

# SmolLM2-135M's vocabulary has no token for these bytes.
MISSING = bytes.fromhex("04 06 13 14 16 1d c0 c1 f1 f2") + bytes(range(0xF5, 0x100))
F1, F2 = chr(0x50000), chr(0x8ABCD)  # unassigned planes: UTF-8 starts with 0xf1 / 0xf2

DROP_CORPUS = [
    "\x04", "\x04\x04\x04", "\x04abc", "abc\x04", "a\x04b", "ab\x04\x06cd", "the\x04 cat",
    "the \x04cat", "the \x04 cat", " \x04", "\x04 ", "\x04\n", "\n\x04\n", "  \x04  ",
    "!\x04!", "!!\x04!!", "...\x13...", "?\x14?\x16?", "**\x1d**", "(\x04)", "'\x04s", "\x04's",
    "x = 1\x04 + 2\x0612", "12\x0434", "1\x04", "\x041", " \x04 1", "a\n\n\x04", "a\n\n\x04b",
    "\t\x04\t", "end\x1d", "\x1d\x1d\x1dstart", "é\x04é", "語\x04語", "😀\x04😀", "½\x04²",
    F1, F2, F1 + F2, "a" + F1 + "b", "!" + F1 + "!", " " + F2 + " ", F1 * 3, "1" + F1 + "2",
    "𐀀" + F1 + "𐀀", F1 + "\x04" + F2, "\x1c\x04\x1c", "\x01\x04\x02",
    "<|im_start|>user\n\x04hi\x04<|im_end|>\n<|im_start|>assistant\nok\x1d!<|im_end|>\n",
    "\x04<|im_end|>\x04", "<|im_end|>\x04<|im_end|>",
    "def f(x):\n\x04    return x\x13  # \x14comment\n",
]  # fmt: skip

DROP_ALPHABET = FUZZ_ALPHABET + [
    "\x04", "\x06", "\x13", "\x14", "\x16", "\x1d", "\x04\x04", F1, F2, "<|im_end|>",
    "<|im_start|>", "!", "!!", "...", " \x04",
]  # fmt: skip


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """(ours, hf, folder): a BPE trained with SmolLM2's pre-tokenizer, lacking its bytes."""
    folder = tmp_path_factory.mktemp("smol")
    hf, _ = train_bpe(folder, alphabet_skip=MISSING)
    ours = build_tokenizer(str(folder))
    assert ours.missing_bytes == MISSING
    return ours, hf, str(folder)


def assert_same_ids(ours, hf, texts):
    expected = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    for text, ids in zip(texts, expected):
        assert ours.encode(text) == ids, repr(text)


def test_hf_drops_bytes_inside_the_piece(smol):
    ours, hf, _ = smol
    # What HF does, spelled out: "\x04" alone is a piece and vanishes; inside a punctuation
    # piece the bytes around it merge ("!\x04!" is the token "!!"); of the four bytes of a
    # character from plane 5 the last three stay.
    assert hf_ids(hf, "\x04") == [] and hf_ids(hf, "\x04\x04 \x1d") == hf_ids(hf, " ")
    bang2 = hf.token_to_id("!!")
    assert bang2 is not None and hf_ids(hf, "!\x04!") == [bang2] == ours.encode("!\x04!")
    assert hf_ids(hf, "a\x04b") == hf_ids(hf, "a") + hf_ids(hf, "b")  # "\x04" is its own piece
    assert hf_ids(hf, F1) == ours.encode(F1)
    assert b"".join(ours.token_bytes(ours.encode(F1))) == F1.encode()[1:] == b"\x90\x80\x80"


def test_parity_on_corpus(smol):
    ours, hf, _ = smol
    assert_same_ids(ours, hf, CORPUS + DIGIT_CORPUS + DROP_CORPUS)
    for text in DROP_CORPUS:  # decode gives the text back, less the dropped bytes
        kept = text.encode().translate(None, MISSING)
        assert ours.encoding.decode_bytes(ours.encode(text)) == kept, repr(text)


def test_parity_fuzz(smol):
    ours, hf, _ = smol
    assert_same_ids(ours, hf, fuzz_texts(3, 3000, DROP_ALPHABET, max_len=30))


def test_fast_path_is_kept(smol, monkeypatch):
    ours, hf, _ = smol

    def slow(*args):
        raise AssertionError("slow path taken")

    monkeypatch.setattr(ours._dropper, "_encode_pieces", slow)
    clean = CORPUS + DIGIT_CORPUS
    assert_same_ids(ours, hf, clean)
    assert [ours.encode_with_offsets(t)[0] for t in clean] == [ours.encode(t) for t in clean]
    with pytest.raises(AssertionError, match="slow path taken"):
        ours.encode("a\x04")
    with pytest.raises(AssertionError, match="slow path taken"):
        ours.encode_with_offsets("<|im_end|>" + F2)


def reference_offsets(ours, text, ids):
    """Token starts from the text itself: the tokens tile the kept bytes in order."""
    data = text.encode()
    kept = [i for i, b in enumerate(data) if b not in ours.missing_bytes]
    starts, n = [], 0
    for token in ours.token_bytes(ids):
        starts.append(kept[n])
        n += len(token)
    assert n == len(kept)
    return starts + [len(data)]


def test_offsets(smol):
    ours, _, _ = smol
    texts = CORPUS + DIGIT_CORPUS + DROP_CORPUS + fuzz_texts(4, 1000, DROP_ALPHABET)
    for text in texts:
        ids, offsets = ours.encode_with_offsets(text)
        assert ids == ours.encode(text), repr(text)
        assert offsets == reference_offsets(ours, text, ids), repr(text)
        data = text.encode()
        assert b"".join(ours.token_bytes(ids)) == data.translate(None, MISSING)
        for start, token in zip(offsets, ours.token_bytes(ids)):
            assert data[start] == token[0]  # each token starts on its own first byte
    # By hand: "a\x04\x04b" is "a" at 0, "b" at 3; "!\x04!" is one token at 0, then "x" at 3.
    assert ours.encode_with_offsets("a\x04\x04b")[1] == [0, 3, 4]
    assert ours.encode_with_offsets("!\x04!x")[1] == [0, 3, 4]
    assert ours.encode_with_offsets("\x04") == ([], [1])
    assert ours.encode_with_offsets("\x04<|im_end|>\x04")[1] == [1, 12]
    # allow_special=False: the markup is text, and offsets still cover it.
    ids, offsets = ours.encode_with_offsets("<|im_end|>\x04!", allow_special=False)
    assert ids == ours.encode("<|im_end|>\x04!", allow_special=False) and offsets[-1] == 12


def test_offsets_without_missing_bytes(tmp_path):
    # The fast path's offsets are the running sums of token lengths; an added token counts its
    # UTF-8 bytes (not characters), and positions are in the text as normalized (NFC for Qwen).
    qwen = build_tokenizer("qwen3")
    for text in CORPUS:
        ids, offsets = qwen.encode_with_offsets(text)
        assert ids == qwen.encode(text)
        lengths = [len(b) for b in qwen.token_bytes(ids)]
        assert offsets == [sum(lengths[:i]) for i in range(len(ids) + 1)]
    assert qwen.encode_with_offsets("cafe\u0301")[1][-1] == len("caf\u00e9".encode())
    data = tiny_json()
    data["added_tokens"].append(dict(data["added_tokens"][0], id=260, content="<|é|>"))
    tok = build_tokenizer(write_json(tmp_path, data))
    assert tok.encode_with_offsets("a<|é|>b") == ([97, 260, 98], [0, 1, 7, 8])  # "<|é|>": 6 bytes


def _runs(tok, ids, mask):
    runs, run = [], []
    for i, m in zip(ids, mask):
        if m:
            run.append(i)
        elif run:
            runs.append(run)
            run = []
    return runs + ([run] if run else [])


@pytest.mark.parametrize("seed", range(4))
def test_render_chat_mask_with_dropped_bytes(smol, seed):
    ours, hf, _ = smol
    rng = random.Random(seed)
    fuzz = fuzz_texts(10 + seed, 12, DROP_ALPHABET[:-5] + ["\x04", "\x1d", F1], max_len=20)
    contents = ["\x04\x04\x04 user says 12\x1d", "Hi\x04!\x04! ½ \x13 " + F1 + " 2024-05-01\x1d",
                "\x04" + F2 + "\x06", *fuzz]
    turns = [("system", "\x06sys\x04")]
    for i in range(6):
        # Not whitespace at the ends: "\n" + " 1" would pre-tokenize into the header's token.
        content = rng.choice(contents).strip(" \t\n\r\x0b\xa0\u3000")
        turns.append(("user" if i % 2 == 0 else "assistant", content))
    ids, mask = render_chat(turns, ours, "chatml")
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    assert ids == hf_ids(hf, text)
    # Trained: each assistant answer and its <|im_end|>, exactly (less the dropped bytes); a
    # dropped byte earlier in the text must not move the mask by a token.
    answers = [c for role, c in turns if role == "assistant"]
    trained = [ours.encoding.decode_bytes(run) for run in _runs(ours, ids, mask)]
    want = [(a + "<|im_end|>").encode().translate(None, MISSING) for a in answers]
    assert b"".join(trained) == b"".join(want)
    assert len(trained) == len(answers)  # one run per answer, nothing else


def test_render_chat_mask_by_hand(smol):
    ours, _, _ = smol
    # Three bytes dropped in the user turn: with offsets summed from token lengths the mask would
    # start three bytes early (on "assistant\n") and stop three bytes early (missing <|im_end|>).
    turns = [("user", "\x04\x06\x13q"), ("assistant", "A\x04!\x04!")]
    ids, mask = render_chat(turns, ours, "chatml")
    trained = [i for i, m in zip(ids, mask) if m]
    assert trained == ours.encode("A!!<|im_end|>")
    assert ids[-len(trained) - 1 :] == [*trained, *ours.encode("\n")]
    assert mask[-len(trained) - 1 :] == [True] * len(trained) + [False]


def test_save_round_trip(smol, tmp_path):
    ours, hf, _ = smol
    out = str(tmp_path / "written")
    save_hf_tokenizer(ours, out)
    back = build_tokenizer(out)
    assert back.missing_bytes == MISSING
    assert back.encoding._mergeable_ranks == ours.encoding._mergeable_ranks
    written = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    texts = DROP_CORPUS + fuzz_texts(5, 500, DROP_ALPHABET)
    assert_same_ids(ours, written, texts)
    assert_same_ids(back, hf, texts)


def test_surrogates_like_tiktoken(smol):
    ours, _, _ = smol
    # tiktoken turns a lone surrogate into U+FFFD; the slow path must see the same text.
    assert ours.encode("a\ud800\x04b") == ours.encode("a\ufffd\x04b")
    ids, offsets = ours.encode_with_offsets("\ud800\x04!")
    assert ids == ours.encode("\ufffd!") and offsets == reference_offsets(ours, "\ufffd\x04!", ids)
    assert offsets[-2:] == [4, 5]  # "!" after the 3 bytes of U+FFFD and the dropped one


def test_refused_layouts(tmp_path):
    # An unk_token: HF would emit it for the missing bytes instead of dropping them.
    data = tiny_json()
    data["model"]["vocab"].pop("z")
    data["model"]["unk_token"] = "<|endoftext|>"
    with pytest.raises(ValueError, match=r"no single-byte token for 1 of the 256 bytes \(e.g. "
                                         r"b'z'\) and model.unk_token is '<\|endoftext\|>'") as info:
        build_tokenizer(write_json(tmp_path / "unk", data))
    assert str(tmp_path / "unk") in str(info.value)
    # Without one the file loads (bytes then dropped); the tiny file's added token would then be
    # numbered 258 by HF, not the 259 it is written with, which is refused as before.
    data["model"]["unk_token"] = None
    with pytest.raises(ValueError, match="written with id 259, but HF tokenizers gives it id 258"):
        build_tokenizer(write_json(tmp_path / "renumbered", data))
    data["added_tokens"][0]["id"] = 258
    data["model"]["vocab"]["Ġt"] = 122  # the freed id: ids stay dense, as a trained BPE's are
    data["model"]["merges"].remove("Ġ t")
    data["model"]["merges"].append("Ġ t")
    path = write_json(tmp_path / "dense", data)
    with pytest.raises(ValueError, match="not in id order"):
        build_tokenizer(path)
    data["model"]["merges"] = ["Ġ t", "a b", "ab c"]
    tok = build_tokenizer(write_json(tmp_path / "dense", data))
    assert tok.missing_bytes == b"z" and tok.encode("zab z t") == [256, 32, 122]
    assert hf_ids(tokenizers.Tokenizer.from_file(str(tmp_path / "dense" / "tokenizer.json")),
                  "zab z t") == [256, 32, 122]
    # A .tiktoken ranks file says nothing about what its HF tokenizer does with such bytes.
    _write_ranks(tmp_path / "r.tiktoken", {bytes([b]): b for b in range(1, 256)})
    with pytest.raises(ValueError, match=r"r.tiktoken: no single-byte token for 1 of the 256"):
        build_tokenizer(str(tmp_path / "r.tiktoken"))


def test_tokenizer_must_declare_missing_bytes():
    ranks = {bytes([b]): b for b in range(256) if b != 4}
    enc = tiktoken.Encoding("t", pat_str=r"\S+|\s+", mergeable_ranks=ranks,
                            special_tokens={"<pad>": 300, "<pâd>": 301})
    with pytest.raises(ValueError, match=r"no single-byte token for b'\\x04', but missing_bytes"):
        Tokenizer("t", enc, "<pad>")
    with pytest.raises(ValueError, match="missing_bytes is b'\\\\x05'"):
        Tokenizer("t", enc, "<pad>", missing_bytes=b"\x05")
    tok = Tokenizer("t", enc, "<pad>", normalizer=None, missing_bytes=b"\x04")
    assert tok.encode("a\x04b c") == [97, 98, 32, 99]
    assert tok.encode_with_offsets("<pâd>\x04b<pad>") == ([301, 98, 300], [0, 7, 8, 13])
