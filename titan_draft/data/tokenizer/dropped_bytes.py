"""Encoding text that holds bytes the BPE has no token for, as HF ``tokenizers`` does.

Some byte-level BPEs lack single-byte tokens (SmolLM2: 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xc0,
0xc1, 0xf1, 0xf2, 0xf5-0xff). HF's BPE, with neither ``unk_token`` nor ``byte_fallback``, looks each
byte of a pre-tokenized piece up and skips the ones it lacks; the rest of the piece then merges as
usual, so a merge can join the bytes on both sides of a dropped one ("!\\x04!" -> "!!"). tiktoken
has no such rule: it panics, and a Rust panic reaches Python as a BaseException that ``except
Exception`` does not catch (it once killed the data thread and hung the trainer).

Most text has none of these bytes (they are rare controls, lead bytes of unassigned planes, or
bytes UTF-8 never uses), so it keeps tiktoken's native ``encode_ordinary``, after one C-speed
check (``bytes.translate`` deleting them). Only text that holds one takes the exact, slower path:
split with the `regex` package (tiktoken's own dependency) and the same pattern, delete the
missing bytes from each piece, BPE what is left with tiktoken's single-piece encoder.

Known gaps of that path, both only for text that holds a missing byte:
- `regex` may know a newer Unicode than tiktoken's and HF's engines (regex 2026.11 vs tiktoken
  0.14: 17144 more ``\\p{L}``, 336 more ``\\p{N}``, no ``\\s`` difference); a character assigned
  since splits differently there.
- A piece that lost a byte is looked up whole before merging, as tiktoken does every piece; HF
  only merges it (even with ``ignore_merges``, whose lookup saw the byte). They agree when the
  merges rebuild every token from its bytes, the condition under which ``hf_tokenizer`` already
  reads ``ignore_merges=false`` as a no-op.
"""

from __future__ import annotations

import functools
import itertools

import regex
import tiktoken

__all__ = ["ByteDroppingEncoder", "token_lengths"]


@functools.lru_cache(maxsize=8)
def token_lengths(encoding: tiktoken.Encoding) -> list[int]:
    """Byte length of every token id (0 for ids that are none): offsets are sums of these, and a
    list lookup is several times cheaper than asking tiktoken for each token's bytes."""
    lengths = [0] * encoding.n_vocab
    # tiktoken keeps no public accessor for its tables; both are read once per encoding.
    for token, rank in encoding._mergeable_ranks.items():
        lengths[rank] = len(token)
    for token, rank in encoding._special_tokens.items():
        lengths[rank] = len(token.encode("utf-8"))
    return lengths


def _fix_surrogates(text: str) -> str:
    # As tiktoken's encode_ordinary does before its own UTF-8 encode, so both paths see one text.
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class ByteDroppingEncoder:
    """Ordinary (no added tokens) encoding with ``missing`` bytes dropped the way HF drops them.

    Args:
        encoding: the tiktoken encoding; it has no single-byte token for any of ``missing``.
        missing: the bytes to drop (non-empty).
    """

    def __init__(self, encoding: tiktoken.Encoding, missing: bytes):
        if not missing:
            raise ValueError(f"tokenizer {encoding.name!r}: no missing bytes to drop")
        self.encoding = encoding
        self.missing = missing
        self._missing_set = frozenset(missing)
        # tiktoken keeps no public accessor for its regex; it is the one tiktoken splits with.
        self._pattern = regex.compile(encoding._pat_str)

    def _utf8(self, text: str) -> tuple[str, bytes]:
        try:
            return text, text.encode("utf-8")
        except UnicodeEncodeError:
            text = _fix_surrogates(text)
            return text, text.encode("utf-8")

    def _clean(self, data: bytes) -> bool:
        return len(data.translate(None, self.missing)) == len(data)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no added-token matching), missing bytes dropped."""
        text, data = self._utf8(text)
        if self._clean(data):
            return self.encoding.encode_ordinary(text)
        return self._encode_pieces(text, None)

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[int], int]:
        """``(ids, starts, n_bytes)``: token ids, the byte offset in ``text``'s UTF-8 where each
        token's first byte is, and that UTF-8's length (dropped bytes included)."""
        text, data = self._utf8(text)
        if self._clean(data):
            ids = self.encoding.encode_ordinary(text)
            lengths = map(token_lengths(self.encoding).__getitem__, ids)
            starts = list(itertools.accumulate(lengths, initial=0))
            starts.pop()  # the end of the last token: the text is covered
            return ids, starts, len(data)
        starts: list[int] = []
        return self._encode_pieces(text, starts), starts, len(data)

    def _encode_pieces(self, text: str, starts: list[int] | None) -> list[int]:
        # Piece by piece in Python: a stretch of text between two pieces with missing bytes cannot
        # go to encode_ordinary whole, because the regex's lookaheads would see the stretch's end
        # as the end of the text ("a\n\n" then "\x04" is "a" "\n" "\n", alone "a" "\n\n").
        missing, encode_piece = self.missing, self.encoding._encode_single_piece
        ids: list[int] = []
        pos, last = 0, 0  # bytes before the current piece; chars matched so far
        for match in self._pattern.finditer(text):
            if match.start() > last:  # text the regex skips: tiktoken skips it too
                pos += len(text[last : match.start()].encode("utf-8"))
            last = match.end()
            piece = match.group().encode("utf-8")
            kept = piece.translate(None, missing)
            if kept:  # a piece of dropped bytes only gives no token at all, as in HF
                piece_ids = encode_piece(kept)
                ids += piece_ids
                if starts is not None:
                    self._piece_starts(piece, len(kept) != len(piece), piece_ids, pos, starts)
            pos += len(piece)
        return ids

    def _piece_starts(
        self, piece: bytes, dropped: bool, piece_ids: list[int], pos: int, starts: list[int]
    ) -> None:
        # The tokens tile the kept bytes in order, so token k starts at the kept byte numbered by
        # the lengths of the tokens before it.
        kept_at = (
            [i for i, b in enumerate(piece) if b not in self._missing_set]
            if dropped
            else range(len(piece))
        )
        lengths, n = token_lengths(self.encoding), 0
        for token in piece_ids:
            starts.append(pos + kept_at[n])
            n += lengths[token]
