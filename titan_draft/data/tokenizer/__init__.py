"""The target's tokenizer on tiktoken, read from HF tokenizer files (``tokenizer.py`` explains how)."""

from titan_draft.data.tokenizer.tokenizer import Tokenizer, build_tokenizer

__all__ = ["Tokenizer", "build_tokenizer"]
