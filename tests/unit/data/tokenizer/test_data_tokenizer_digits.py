"""HF's Sequence[Digits, ByteLevel] pre-tokenizer (SmolLM2's) as one tiktoken regex.

The reference is HF `tokenizers` itself: its pre-tokenizer's pieces against our regex's, and its
ids against ours on BPEs it trains here with that pre-tokenizer (individual digits and runs).
"""

import json
import os
import random

import pytest

from test_data_tokenizer_hf import CORPUS, assert_parity, hf_ids, write_json
from titan_draft.data.tokenizer.hf import (
    GPT2_DIGIT_RUNS_PAT,
    GPT2_DIGITS_PAT,
    GPT2_PAT,
    bytes_to_unicode,
)
from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer
from titan_draft.data.tokenizer import build_tokenizer

tokenizers = pytest.importorskip("tokenizers")
regex = pytest.importorskip("regex")  # tiktoken's own dependency

DIGIT_CORPUS = [
    "0", "7 8 9", "1234567890", "3.14159", "-2.5e-10", "1,000,000.00", "2024-05-01T12:34:56Z",
    "v1.2.3", "x1y2z3", "abc123def", "a 1 b  22 c   333 d", "  12", "\t\t42\n\n 7", "1\n2\r\n3",
    "12 ", "42  ", "99\n", "7\n\n\n", "price: $1,299.99!", "(1+2)*3=9", "'1's 2'll 3'd 4's",
    "½ ² ٣ ⅔ ¾ ⁵ ₇ ① Ⅻ 〇 ٠١٢٣ ۴۵ ߁߂ १२३", "x²+y³=z⁴", "3½ cups", "１２３ full-width",
    "10:30pm, 10/11/2024", "#1 #22 #333", "a1 b22 c333\n    404\n", "0x1F 0b1010 1e9",
    "ID: 00042", "   \n  1", "1   ", "  \t 1 \t ", "word  \n\n  42  \n\n", "a\u00a0\u00a01\u3000 2",
    "def f(x):\n    return x * 2 + 10  # 10\n\n\n    12", "Ελληνικά 12 Привет 34 日本 56",
    "I ❤️ 2 emoji 😀3😃 👍🏽4", "<|im_start|>user\n12 + 30?<|im_end|>\n<|im_start|>assistant\n42",
]  # fmt: skip

# Text for the trainer: digits in every context, so the vocabulary has tokens (whitespace runs,
# "\n\n", "  ") whose ids change if the regex cuts them at the wrong place.
TRAIN_TEXT = CORPUS * 2 + DIGIT_CORPUS * 3 + [
    "for i in range(10):\n    print(i, i * i)  # squares\n        x = 1\n\n\n    y = 22\n",
    "Table 1: 12   34   56\n       78   90\n\t\t 7 \t 8\n  \n  9",
    "In 1969, 3 people flew 384,400 km; 12 months later, 2 more went. ½ of 10 is 5.",
    "!!! ... ??? *** --- !!?? ''' ``` ;;; ::: ((( ))) [[[ ]]] {{{ }}} ### @@@",
    "Linear B: 𐀀𐀁𐀂 𐀀𐀀 Gothic: 𐌰𐌱𐌲 𐌰𐌰 math: 𝔸𝔹 𝟘𝟙𝟚",
] * 2


def train_bpe(folder, *, individual_digits=True, alphabet_skip=b"", vocab_size=1500, text=None):
    """A BPE trained by HF with Sequence[Digits, ByteLevel(use_regex=true)], saved in ``folder``.

    ``alphabet_skip``: bytes left out of the initial alphabet; the training text must not hold
    them, so the vocabulary has no token for them, as SmolLM2's has none for 0x04 and others.
    """
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=individual_digits),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    skip = set(alphabet_skip)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],  # ids 0.., as SmolLM2
        initial_alphabet=[c for b, c in bytes_to_unicode().items() if b not in skip],
        show_progress=False,
    )
    texts = TRAIN_TEXT if text is None else text
    assert not any(set(t.encode("utf-8")) & skip for t in texts)
    tok.train_from_iterator(texts, trainer)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    return tokenizers.Tokenizer.from_file(path), path


def hf_pieces(text, individual_digits):
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=individual_digits),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    back = {c: b for b, c in bytes_to_unicode().items()}
    return [bytes(back[c] for c in s).decode("utf-8") for s, _ in pre.pre_tokenize_str(text)]


FUZZ_ALPHABET = [
    "a", "b", "Z", "é", "ß", "語", "ж", "ا", " ", " ", " ", "  ", "\t", "\n", "\n", "\r\n",
    "\u00a0", "\u3000", "\x0b", "\x1c", "0", "1", "9", "42", "½", "²", "٣", "①", "Ⅻ", "१", ".",
    ",", "!", "?", "'", "'s", "'ll", "-", "_", "(", "#", "😀", "👍🏽", "𐀀", "\u0301", "\x01",
]  # fmt: skip


def fuzz_texts(seed, n, alphabet=FUZZ_ALPHABET, max_len=24):
    rng = random.Random(seed)
    return ["".join(rng.choices(alphabet, k=rng.randint(1, max_len))) for _ in range(n)]


@pytest.mark.parametrize("individual", [True, False])
def test_regex_splits_like_hf_pipeline(individual):
    # The derived regex against HF's two-step pipeline, piece for piece, and GPT-2's own regex
    # as a control: it differs, so this corpus does tell the two apart.
    pat = regex.compile(GPT2_DIGITS_PAT if individual else GPT2_DIGIT_RUNS_PAT)
    texts = CORPUS + DIGIT_CORPUS + fuzz_texts(1, 2000)
    for text in texts:
        assert pat.findall(text) == hf_pieces(text, individual), repr(text)
    assert any(regex.findall(GPT2_PAT, t) != hf_pieces(t, individual) for t in texts)


@pytest.mark.parametrize("individual", [True, False])
def test_trained_digits_bpe_parity(tmp_path, individual):
    hf, path = train_bpe(tmp_path / "bpe", individual_digits=individual)
    with open(path, encoding="utf-8") as f:
        pre = json.load(f)["pre_tokenizer"]
    assert [p["type"] for p in pre["pretokenizers"]] == ["Digits", "ByteLevel"]
    ours = build_tokenizer(path)
    assert ours.encoding._pat_str == (GPT2_DIGITS_PAT if individual else GPT2_DIGIT_RUNS_PAT)
    assert ours.missing_bytes == b""
    assert_parity(ours, hf, CORPUS + DIGIT_CORPUS)
    fuzz = fuzz_texts(2, 1500)
    expected = [e.ids for e in hf.encode_batch(fuzz, add_special_tokens=False)]
    assert [ours.encode(t) for t in fuzz] == expected
    if not individual:  # runs of digits are one piece: the trainer merged some into tokens
        assert len(ours.encode("1234567890")) < 10

    # Written back (Split with the derived regex, then ByteLevel without one), HF agrees too.
    out = str(tmp_path / "written")
    save_hf_tokenizer(ours, out)
    assert build_tokenizer(out).encoding._pat_str == ours.encoding._pat_str
    again = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert_parity(ours, again, CORPUS + DIGIT_CORPUS)
    assert [e.ids for e in again.encode_batch(fuzz, add_special_tokens=False)] == expected


def _with_pre(tmp_path, name, pre):
    from test_data_tokenizer_hf import tiny_json

    data = tiny_json()
    data["pre_tokenizer"] = pre
    return write_json(tmp_path / name, data)


def test_digits_layout_errors(tmp_path):
    def byte_level(use_regex):
        return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                "use_regex": use_regex}

    digits = {"type": "Digits", "individual_digits": True}
    seq = {"type": "Sequence", "pretokenizers": [digits, byte_level(False)]}
    with pytest.raises(ValueError, match=r"Sequence\[Digits, ByteLevel\] is supported with "
                                         r"ByteLevel\(use_regex=true\) only") as info:
        build_tokenizer(_with_pre(tmp_path, "no_regex", seq))
    assert str(tmp_path) in str(info.value)
    seq = {"type": "Sequence", "pretokenizers": [dict(digits, individual_digits="yes"),
                                                 byte_level(True)]}
    with pytest.raises(ValueError, match="individual_digits is 'yes', not a boolean"):
        build_tokenizer(_with_pre(tmp_path, "not_bool", seq))
    seq = {"type": "Sequence", "pretokenizers": [byte_level(True), digits]}
    with pytest.raises(ValueError, match=r"unsupported pre_tokenizer Sequence\[ByteLevel, Digits\]"):
        build_tokenizer(_with_pre(tmp_path, "order", seq))
    seq = {"type": "Sequence", "pretokenizers": [digits, dict(byte_level(True),
                                                              add_prefix_space=True)]}
    with pytest.raises(ValueError, match=r"pretokenizers\[1\].add_prefix_space is true"):
        build_tokenizer(_with_pre(tmp_path, "prefix", seq))
    # The tiny hand-written BPE with HF's layout: by hand, " 12" is " ", "1", "2".
    seq = {"type": "Sequence", "pretokenizers": [digits, byte_level(True)]}
    tok = build_tokenizer(_with_pre(tmp_path, "ok", seq))
    assert tok.encode("t 12") == [116, 32, 49, 50]
    assert hf_ids(tokenizers.Tokenizer.from_file(str(tmp_path / "ok" / "tokenizer.json")),
                  "t 12") == [116, 32, 49, 50]
