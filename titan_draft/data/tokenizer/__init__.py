"""The target's tokenizer on tiktoken, read from HF tokenizer files."""
