"""HF tokenizer files -> tiktoken, for byte-level BPE tokenizers (Qwen2/2.5/3, Llama-3.x, GPT-2).

Users arrive with an HF folder (``tokenizer.json``, ``tokenizer_config.json``, maybe a ``.tiktoken``
ranks file); training must produce the ids the HF tokenizer gives, using only tiktoken at run time.
This module holds the shared pieces (byte-level alphabet, regexes, ranks files, the checks on a
BPE table) and builds the tiktoken ``Encoding``; ``hf_tokenizer_files`` reads the HF files.

Why the translation holds: a byte-level BPE is a table of byte strings with ids, a pre-tokenizer
regex and a merge order. tiktoken uses the id as the rank and, inside each regex piece, merges the
adjacent pair whose concatenation has the lowest rank; HF merges the pair listed first in
``merges``. They agree when merge order is id order and every token is built by the merges, which
holds for BPE trained by ``tokenizers`` and for files converted from tiktoken ranks (Qwen,
Llama-3); both are checked here, along with everything tiktoken would silently do differently (an
id given to two tokens, a regex that drops text) or panic on (a byte without a token, below).
What no cheap check proves (tiktoken also merges a pair that spells a token when no merge lists
that pair) is covered by the parity tests against HF ``tokenizers``.

``ignore_merges``: tiktoken always looks a whole regex piece up in its ranks before merging, which
is HF's ``ignore_merges=true`` (Llama-3 sets it to match tiktoken). With ``false`` (Qwen, trained
BPE) HF's merges rebuild a vocabulary word from its bytes anyway for these BPEs, so the flag is
read as a no-op (tested on Qwen's tokens).

Added tokens: HF numbers them itself when it loads a file (``hf_added_token_ids``) and matches
them in the raw text before the normalizer and BPE run; all of them, special or not, become
tiktoken special tokens. Post-processors (Llama-3's BOS) are ignored: chat templates write BOS.
Known gap: an added token marked ``normalized: true`` is matched in the raw text here, in the
normalized text by HF; they differ only if NFC changes the characters around it.

Bytes without a token (SmolLM2 has none for 0x04, 0xf1 and 19 others): HF's BPE with neither
``unk_token`` nor ``byte_fallback`` skips such a byte inside its piece and merges the rest of the
piece as usual, so the text still encodes, minus those bytes. tiktoken panics on them instead, so
such a table is accepted only where HF drops (``TokenizerFiles.missing_bytes``) and the encoding
is then used through ``dropped_bytes``, which drops them as HF does. Refused instead: a BPE with
an ``unk_token`` (HF emits the unk id there, and a symbol that blocks merges; no supported model
needs it) and a ``.tiktoken`` file (it does not say what its HF tokenizer does with such bytes).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools

import tiktoken

__all__ = [
    "GPT2_DIGITS_PAT",
    "GPT2_DIGIT_RUNS_PAT",
    "GPT2_PAT",
    "LLAMA3_PAT",
    "QWEN_PAT",
    "TokenizerFiles",
    "build_encoding",
    "bytes_to_unicode",
    "check_ranks",
    "load_tiktoken_ranks",
    "missing_bytes",
    "to_byte_level",
]

# The regex HF's ByteLevel pre-tokenizer applies with use_regex=true (GPT-2's).
GPT2_PAT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# HF's Sequence[Digits(individual_digits=true), ByteLevel(use_regex=true)] (SmolLM2) as one regex,
# and with individual_digits=false (runs of digits); hf_tokenizer_pretok's docstring derives them.
GPT2_DIGITS_PAT = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"
)
GPT2_DIGIT_RUNS_PAT = (
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"
)
# Llama-3.x: numbers in groups of up to three digits.
LLAMA3_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2/Qwen2.5/Qwen3: one digit per token (`\p{N}` alone); otherwise Llama-3's.
QWEN_PAT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A .tiktoken file is ranks only: no regex, no normalizer. We recognize the families we know by
# their rank count rather than guess (tokenizer.json carries the regex and is preferred).
_TIKTOKEN_FAMILIES = {
    151643: ("Qwen2/2.5/3", QWEN_PAT, "NFC"),
    128000: ("Llama-3.x", LLAMA3_PAT, None),
}

# Text a pre-tokenizer regex must reproduce byte for byte: tiktoken drops what the regex does not
# match, where HF keeps it as its own piece.
_PROBE = (
    "Hello, World! It's 2024-05-01; x_1 = 3.14e-2.\n\n\tdef f(a):\r\n        return a  # ok\n"
    "日本語のテキスト。Привет, мир! مرحبا بالعالم café naïve 👍🏽👨\u200d👩\u200d👧 🇫🇷 \u00a0\u3000 "
    "   \n\n\n  "
)


@functools.lru_cache(maxsize=None)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, 0x7f-0xa0,
    0xad) are given the characters U+0100, U+0101, ... in byte order, so every token is printable.
    """
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(0x100 + n) for n, b in enumerate(others)})
    return table


@functools.lru_cache(maxsize=None)
def _from_byte_level_table() -> dict[int, int]:
    # str.translate table: byte-level character -> Latin-1 character of its byte, so that
    # ``s.translate(table).encode("latin-1")`` gives the token's bytes in one C call.
    return {ord(c): b for b, c in bytes_to_unicode().items()}


def to_byte_level(data: bytes) -> str:
    """``data`` written in the byte-level alphabet, as tokenizer.json vocabularies spell tokens."""
    # Latin-1 maps each byte to the character of the same number; translate renames those.
    return data.decode("latin-1").translate(bytes_to_unicode())


@dataclasses.dataclass
class TokenizerFiles:
    """What a tokenizer file or folder describes, in tiktoken's terms.

    Attributes:
        source: the file the BPE came from (tokenizer.json or a ranks file), for messages.
        ranks: token bytes -> id of every BPE token (tiktoken's ``mergeable_ranks``).
        special_tokens: every HF added token, special or not -> id (matched in text before BPE).
        non_special_tokens: added tokens HF marks ``special: false`` (e.g. Qwen3's ``<think>``).
        pat_str: the pre-tokenizer regex.
        normalizer: ``"NFC"`` or None.
        bos_token, eos_token, pad_token: as tokenizer_config.json names them (None if absent).
        missing_bytes: the bytes (ascending) that have no single-byte token; non-empty only where
            HF drops them from the text (a BPE without unk_token and byte_fallback).
        chat_template: the Jinja chat template the folder ships (None if none); carried, never
            rendered here.
    """

    source: str
    ranks: dict[bytes, int]
    special_tokens: dict[str, int]
    non_special_tokens: frozenset[str]
    pat_str: str
    normalizer: str | None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    missing_bytes: bytes = b""
    chat_template: str | None = None


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Ranks of a tiktoken file: one ``<base64 token> <rank>`` per line (Qwen's ``qwen.tiktoken``,
    Llama-3's ``original/tokenizer.model``)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (ValueError, binascii.Error):
            raise ValueError(
                f"{path}: line {lineno} is not '<base64 token> <rank>', so this is not a "
                "tiktoken ranks file (a SentencePiece tokenizer.model, as Llama-2 ships, is not a "
                "byte-level BPE and is not supported)"
            ) from None
        if token in ranks:
            raise ValueError(f"{path}: line {lineno}: token {token!r} is listed twice")
        ranks[token] = rank
    if not ranks:
        raise ValueError(f"{path}: empty tiktoken ranks file")
    return ranks


def check_unique_ids(where: str, ids: dict) -> None:
    """Every value of ``ids`` (token -> id) is an int >= 0 and no two tokens share one; the
    errors start with ``where``, the table's name (e.g. ``"<file>: model.vocab"``)."""
    seen: dict[int, object] = {}
    for token, i in ids.items():
        if not isinstance(i, int) or i < 0:
            raise ValueError(f"{where} gives {token!r} the id {i!r}; ids must be integers >= 0")
        if i in seen:
            raise ValueError(f"{where} gives id {i} to both {seen[i]!r} and {token!r}")
        seen[i] = token


def missing_bytes(ranks: dict[bytes, int]) -> bytes:
    """The bytes (ascending) that ``ranks`` has no single-byte token for."""
    return bytes(b for b in range(256) if bytes([b]) not in ranks)


def check_ranks(source: str, ranks: dict[bytes, int], *, allow_missing: bool = False) -> bytes:
    """Checks ``ranks`` as tiktoken needs them; returns the bytes without a single-byte token.

    Missing bytes are refused unless ``allow_missing`` (the caller has seen that HF drops them
    and encodes through ``dropped_bytes``): tiktoken panics, not a Python error, on text with
    such a byte. A shared id would make tiktoken panic too.
    """
    check_unique_ids(f"{source}: the ranks table", ranks)
    missing = missing_bytes(ranks)
    if missing and not allow_missing:
        raise ValueError(
            f"{source}: no single-byte token for {len(missing)} of the 256 bytes (e.g. "
            f"{missing[:1]!r}); a byte-level BPE needs all of them to encode any text"
        )
    return missing


def _check_specials_vs_ranks(
    source: str, ranks: dict[bytes, int], specials: dict[str, int]
) -> None:
    check_unique_ids(f"{source}: the added-token table", specials)
    by_id = {rank: token for token, rank in ranks.items()}
    for content, tid in specials.items():
        token = by_id.get(tid)
        if token is not None and token != content.encode("utf-8"):
            raise ValueError(
                f"{source}: added token {content!r} has id {tid}, which is the BPE token {token!r}"
            )


def build_encoding(files: TokenizerFiles, name: str) -> tiktoken.Encoding:
    """The tiktoken ``Encoding`` of ``files``; fails if the regex does not compile or drops text."""
    try:
        encoding = tiktoken.Encoding(
            name=name,
            pat_str=files.pat_str,
            mergeable_ranks=files.ranks,
            special_tokens=files.special_tokens,
        )
    except ValueError as e:
        raise ValueError(
            f"{files.source}: pre-tokenizer regex {files.pat_str!r} does not compile for "
            f"tiktoken: {e}"
        ) from None
    # Characters with a byte the BPE lacks would make tiktoken panic here; the regex is about
    # character classes, which the rest of the probe still covers.
    probe = "".join(c for c in _PROBE if not set(c.encode("utf-8")) & set(files.missing_bytes))
    if encoding.decode_bytes(encoding.encode_ordinary(probe)) != probe.encode("utf-8"):
        raise ValueError(
            f"{files.source}: pre-tokenizer regex {files.pat_str!r} does not match all text "
            "(tiktoken drops what it does not match, HF keeps it), so the two would differ"
        )
    return encoding
