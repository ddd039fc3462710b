"""A tokenizer.json's normalizer and pre-tokenizer, as tiktoken's one regex (and NFC or nothing).

tiktoken splits text with a single regex, HF with a pipeline of pre-tokenizers; only pipelines
that one regex reproduces piece for piece are accepted, everything else is refused by name.

``Sequence[Digits, ByteLevel(use_regex=true)]`` (SmolLM2): HF first cuts every number character
(Rust's ``char::is_numeric``, i.e. ``\\p{N}``), or every run of them, out as a piece of its own,
then runs GPT-2's regex inside each remaining piece, where the piece's end is the end of the text.
One regex does both when (1) the digit branch is ``\\p{N}`` (``\\p{N}+`` for runs) without GPT-2's
optional leading space: inside a digit-free piece a space can never precede a digit; and (2)
``\\s+(?!\\S)`` also accepts a digit after the whitespace, since that digit ends the piece. The
other branches never cross a digit, so every match ends where the two-step pipeline's does.
Known gap: HF's Digits uses Rust's own Unicode tables, newer than its regex engine's and
tiktoken's; the 13 digits they lack (U+11DE0-U+11DE9, U+16FF4-U+16FF6 with tokenizers 0.23 and
tiktoken 0.14) are cut out by HF only, which changes ids next to punctuation.
"""

from __future__ import annotations

from titan_draft.data.tokenizer.hf import GPT2_DIGIT_RUNS_PAT, GPT2_DIGITS_PAT, GPT2_PAT

__all__ = ["SENTENCEPIECE_HINT", "describe", "normalizer_name", "pre_tokenizer_pattern"]

SENTENCEPIECE_HINT = (
    "not a byte-level BPE (this looks like a SentencePiece-style tokenizer, e.g. Llama-2 or "
    "Mistral); only byte-level BPE tokenizers (Qwen2/3, Llama-3, GPT-2 style) are supported"
)


def describe(component: dict | None) -> str:
    """``"Sequence[Digits, ByteLevel]"``-style name of a normalizer or pre-tokenizer, for messages."""
    if component is None:
        return "null"
    kind = component.get("type")
    inner = component.get("pretokenizers") or component.get("normalizers")
    if kind == "Sequence" and isinstance(inner, list):
        return "Sequence[" + ", ".join(describe(c) for c in inner) + "]"
    return str(kind)


def _check_byte_level_step(path: str, step: dict, where: str) -> None:
    if step.get("add_prefix_space"):
        raise ValueError(
            f"{path}: {where}.add_prefix_space is true (HF then prepends a space to every text "
            "segment); not supported"
        )


def _split_then_byte_level(path: str, split: dict, byte_level: dict) -> str:
    _check_byte_level_step(path, byte_level, "pre_tokenizer.pretokenizers[1]")
    pattern = split.get("pattern")
    regex = pattern.get("Regex") if isinstance(pattern, dict) else None
    if (
        isinstance(regex, str)
        and split.get("behavior") == "Isolated"
        and not split.get("invert", False)
        and not byte_level.get("use_regex", True)
    ):
        return regex
    raise ValueError(
        f"{path}: pre_tokenizer Sequence[Split, ByteLevel] must be Split(pattern={{'Regex': "
        "...}, behavior='Isolated', invert=false) then ByteLevel(use_regex=false); got "
        f"Split(pattern={pattern!r}, behavior={split.get('behavior')!r}, "
        f"invert={split.get('invert')!r}), "
        f"ByteLevel(use_regex={byte_level.get('use_regex', True)!r})"
    )


def _digits_then_byte_level(path: str, digits: dict, byte_level: dict) -> str:
    _check_byte_level_step(path, byte_level, "pre_tokenizer.pretokenizers[1]")
    if not byte_level.get("use_regex", True):
        # Then the pieces are digits and whole digit-free stretches: tiktoken could do it, but
        # no real tokenizer does and BPE over a whole paragraph is quadratic.
        raise ValueError(
            f"{path}: pre_tokenizer Sequence[Digits, ByteLevel] is supported with "
            "ByteLevel(use_regex=true) only; got use_regex=false"
        )
    individual = digits.get("individual_digits", False)
    if not isinstance(individual, bool):
        raise ValueError(
            f"{path}: pre_tokenizer.pretokenizers[0].individual_digits is {individual!r}, not a "
            "boolean"
        )
    return GPT2_DIGITS_PAT if individual else GPT2_DIGIT_RUNS_PAT


def pre_tokenizer_pattern(path: str, pre: dict | None) -> str:
    """The single regex that splits text into the BPE pieces HF's ``pre_tokenizer`` makes."""
    kinds = describe(pre)
    if pre is None or "Metaspace" in kinds:
        raise ValueError(f"{path}: pre_tokenizer is {kinds}: {SENTENCEPIECE_HINT}")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        _check_byte_level_step(path, pre, "pre_tokenizer")
        return GPT2_PAT
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if steps and len(steps) == 2 and kinds == "Sequence[Split, ByteLevel]":
        return _split_then_byte_level(path, *steps)
    if steps and len(steps) == 2 and kinds == "Sequence[Digits, ByteLevel]":
        return _digits_then_byte_level(path, *steps)
    raise ValueError(
        f"{path}: unsupported pre_tokenizer {kinds}; supported: ByteLevel(use_regex=true), "
        "Sequence[Split(Regex, Isolated), ByteLevel(use_regex=false)] or "
        "Sequence[Digits, ByteLevel(use_regex=true)]"
    )


def normalizer_name(path: str, norm: dict | None) -> str | None:
    """``"NFC"`` or None for the normalizers tiktoken's callers can apply; refuses the others."""
    if norm is None:
        return None
    kinds = [norm.get("type")]
    if kinds == ["Sequence"]:
        kinds = [n.get("type") for n in norm.get("normalizers") or []]
    if not kinds:
        return None
    if kinds == ["NFC"]:
        return "NFC"
    raise ValueError(f"{path}: unsupported normalizer {describe(norm)}; supported: null or NFC")
