"""The real SmolLM2-135M-Instruct folder through titan_draft's own tokenizer: build_tokenizer gives
HF ``tokenizers``' ids (digits one by one, control bytes the vocabulary lacks dropped), and the
loss mask stays exact on such text."""

from __future__ import annotations

import json
import os

import pytest
from tokenizers import Tokenizer as HFTokenizer

from titan_draft.data.chat.template import Turn, render_chat, resolve_template
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


def test_sharegpt_rows_equal_hf(tokenizers, chat_jsonl):
    """Real chat text (the first 400 ShareGPT rows) encodes to HF's ids."""
    ours, hf = tokenizers
    with open(chat_jsonl) as f:
        for line in f:
            for turn in json.loads(line).get("conversations", []):
                value = turn.get("value")
                if isinstance(value, str):
                    assert ours.encode(value) == hf.encode(value, add_special_tokens=False).ids


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


def test_draft_args_follow_the_target(smollm2_dir):
    """The smollm2 flavor against the real folder: width and heads fit, RoPE / context / eps
    come from the target, and the mask token is a special token no ChatML turn writes."""
    from titan_draft.features.target import read_hf_config
    from titan_draft.config import ConfigManager
    from titan_draft.protocols import get_model_spec
    from titan_draft.components.model_args import resolve_model_args
    from titan_draft.data.chat.format import build_chat_format

    from models.targets.llama3 import args_from_hf_config

    target = args_from_hf_config(read_hf_config(smollm2_dir))
    tok = build_tokenizer(smollm2_dir)
    spec = get_model_spec("dflash2")
    cfg = ConfigManager().parse_args(["--model.flavor", "smollm2", "--data.chat_template", "auto"])
    args = resolve_model_args(spec, cfg, target, tok, build_chat_format(cfg.data, tok))
    assert (args.rope_theta, args.max_position_embeddings, args.rms_norm_eps) == (1e5, 8192, 1e-5)
    assert args.target_layer_ids == [1, 14, 27] and args.vocab_size == 49152
    assert tok.decode([args.mask_token_id]) == "<empty_output>" and spec.reserved_tokens_fn(args) == [16]
    pinned = ConfigManager().parse_args(["--model.flavor", "smollm2", "--model.args.rope_theta", "10000"])
    assert resolve_model_args(spec, pinned, target, tok, build_chat_format(pinned.data, tok)).rope_theta == 10000
    with pytest.raises(ValueError, match=r"hidden_size 64 != target hidden_size 576.*'smollm2'"):
        debug = ConfigManager().parse_args(["--model.flavor", "debugmodel"])
        resolve_model_args(spec, debug, target, tok, build_chat_format(debug.data, tok))
