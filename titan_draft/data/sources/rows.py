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
splits next to it are never picked up by accident; they are named in the log). Reading them is
``files.py``; splitting them into held-out rows and each DP rank's rows is ``split_rows``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from titan_draft.data.chat.template import Turn
from titan_draft.data.sources.files import BAD_JSON
from titan_draft.data.sources.registry import source_rows

__all__ = [
    "BAD_JSON",
    "SKIP_REASONS",
    "RowSplit",
    "load_rows",
    "normalize_row",
    "prompt_key",
    "split_rows",
]

SKIP_REASONS = (
    "bad_json",  # a .jsonl line (or a cut-off last row) that does not parse
    "no_conversations",  # not an object with a non-empty "conversations" / "messages" list
    "unknown_role",  # a speaker that is none of system / user / assistant (or their aliases)
    "tool_use",  # tool messages, tool calls or a row's tool definitions: no format here renders them
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
    if row.get("tools") or row.get("functions"):
        # tool definitions change what a template renders (a folder's own may list them in the
        # system turn); no format here renders them, so the row would train on another prompt
        return "tool_use"
    turns: list[Turn] = []
    for raw in convs:
        turn = _normalize_turn(raw)
        if isinstance(turn, str):
            return turn
        turns.append(turn)
    return _check_structure(turns, prompt_only)


def prompt_key(row: Any) -> tuple[tuple[str, str], ...] | None:
    """A row's prompt (its system turn and first user turn, as ``(role, text)`` pairs), or None
    for a row without one: two rows with one key ask the target the same question."""
    turns = normalize_row(row, prompt_only=True)
    return None if isinstance(turns, str) else tuple((t.role, t.content) for t in turns)


@dataclass
class RowSplit:
    """One DP rank's rows of a source, after the held-out ones."""

    rows: list[Any]  # this rank's raw rows
    total: int  # rows of the (max_rows-limited) source after the held-out ones, all ranks
    positions: list[int]  # each of ``rows``' 0-based row number in the source
    held_out_repeats: int  # rows left out because they ask a held-out row's prompt


def split_rows(
    source: str, *, max_rows: int = 0, dp_rank: int = 0, dp_world: int = 1, skip_rows: int = 0
) -> RowSplit:
    """This DP rank's rows of ``source`` (see ``load_rows``), with where each came from.

    The first ``skip_rows`` rows are held out, and so is every later row that asks one of their
    prompts (``prompt_key``): chat dumps repeat prompts ("continue" is 1.5 % of regenerated
    ShareGPT), and a greedy target answers a repeated prompt the same way, so without this the
    held-out answers would be trained on word for word. Rank ``r`` owns rows ``r, r + dp_world,
    ...`` of the next ``max_rows`` remaining rows (all when ``max_rows`` is 0).

    Raises:
        ValueError: naming ``data.source`` when the source is missing, unreadable or empty.
    """
    if max_rows < 0:
        raise ValueError(f"data.max_rows: must be >= 0, got {max_rows}")
    if skip_rows < 0:
        raise ValueError(f"data.holdout_rows: must be >= 0, got {skip_rows}")
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank {dp_rank} is outside dp_world {dp_world}")
    split = RowSplit([], 0, [], 0)
    held_out: set[tuple[tuple[str, str], ...]] = set()
    for position, row in enumerate(source_rows(source)):
        if position < skip_rows:
            key = prompt_key(row)
            if key is not None:
                held_out.add(key)
            continue
        if max_rows and split.total >= max_rows:
            break
        if held_out and prompt_key(row) in held_out:
            split.held_out_repeats += 1
            continue
        if split.total % dp_world == dp_rank:
            split.rows.append(row)
            split.positions.append(position)
        split.total += 1
    if split.total == 0:
        if skip_rows:
            raise ValueError(f"data.source: {source!r} has no rows after the {skip_rows} held-out "
                             f"rows (data.holdout_rows) and the {split.held_out_repeats} that repeat "
                             "their prompts")
        raise ValueError(f"data.source: {source!r} has no rows")
    return split


def load_rows(
    source: str, *, max_rows: int = 0, dp_rank: int = 0, dp_world: int = 1, skip_rows: int = 0
) -> tuple[list[Any], int]:
    """Raw rows of one DP rank: ``(rows of this rank, number of rows in the limited source)``.

    The first ``skip_rows`` rows are passed over (``data.holdout_rows``: held out for the eval),
    with every later row asking one of their prompts. Rank ``r`` owns rows ``r, r + dp_world,
    ...`` of the next ``max_rows`` rows (all when ``max_rows`` is 0), so ranks are disjoint and
    together cover the source. ``split_rows`` says where each row came from.

    Raises:
        ValueError: naming ``data.source`` when the source is missing, unreadable or empty.
    """
    split = split_rows(source, max_rows=max_rows, dp_rank=dp_rank, dp_world=dp_world, skip_rows=skip_rows)
    return split.rows, split.total
