"""Sequence packing: whole conversations placed into rows of exactly ``data.max_length`` tokens.

Real chat data is mostly shorter than ``max_length`` (ShareGPT's first exchanges fill 24 % of a
2048-token row), so a padded row is mostly padding. A packed row holds several conversations
(documents) back to back, then padding; the shape stays ``[B, max_length]``, so compiled blocks and
float8 see one shape per run. ``document_ids`` tells the target and the draft where each
document starts and ends (``TargetFeatures.document_spans``): nothing is computed across a
document boundary, so a packed document trains as it would alone.

Placement (``PackingNode``): a window of the next ``window`` conversations waits; each row takes
the oldest waiting one first (no conversation waits for long, and the order stays close to the
source's seeded shuffle), then repeatedly the longest waiting one that still fits (best fit, the
oldest among equals) until none fits. It is deterministic given the source's order.

Exact resume with a small state: the node keeps the source's state from just before the oldest
conversation still waiting, and one flag per conversation drawn since (placed or waiting). A
resume restores the source there, draws the same conversations again and drops the placed ones;
the source's own counters (epochs, skipped rows) come out as they were.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torchdata.nodes as tn

from titan_draft.data.sources.chat import Sample

__all__ = ["PACKING_KEY", "PackingNode", "collate_packed", "packed_counts"]

# Key of this node's state in the Loader state.
PACKING_KEY = "packing"

Row = list[Sample]


@dataclass
class _Drawn:
    state_before: dict[str, Any]  # the source's state before this conversation was drawn
    sample: Any
    length: int
    placed: bool = False


def _sample_length(sample: Sample) -> int:
    return len(sample[0])


class PackingNode(tn.BaseNode[list]):
    """Rows of whole samples, each at most ``max_length`` long, whose lengths sum to at most
    ``max_length``, from ``source`` (module docstring).

    Args:
        source: a node of samples already truncated to ``max_length``: ``(input_ids, loss_mask)``
            (``ChatSourceNode``, synthetic rows) or anything ``length`` measures (cached rows).
        max_length: tokens per row.
        window: conversations a row may be filled from (``data.packing_window``).
        length: a sample's token count.
    """

    def __init__(self, source: tn.BaseNode, *, max_length: int, window: int,
                 length: Callable[[Any], int] = _sample_length):
        super().__init__()
        if window < 1:
            raise ValueError(f"data.packing_window: must be >= 1, got {window}")
        self.source, self.max_length, self.window, self.length = source, max_length, window, length
        self._drawn: list[_Drawn] = []

    def reset(self, initial_state: Optional[dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self._drawn = []
        if initial_state is None:
            self.source.reset(None)
            return
        state = initial_state[PACKING_KEY]
        self.source.reset(state["source"])
        for placed in state["placed"]:
            entry = self._draw()
            entry.placed = placed
        self._drop_placed_prefix()

    def _draw(self) -> _Drawn:
        state = copy.deepcopy(self.source.state_dict())
        sample = self.source.next()
        entry = _Drawn(state, sample, self.length(sample))
        if entry.length > self.max_length:
            raise ValueError(f"packing: a sample of {entry.length} tokens is longer than a row "
                             f"({self.max_length}); the source must truncate to data.max_length")
        self._drawn.append(entry)
        return entry

    def _waiting(self) -> list[_Drawn]:
        return [e for e in self._drawn if not e.placed]

    def _drop_placed_prefix(self) -> None:
        while self._drawn and self._drawn[0].placed:
            self._drawn.pop(0)

    def next(self) -> list:
        waiting = self._waiting()
        while len(waiting) < self.window:
            waiting.append(self._draw())
        row = [waiting[0]]  # the oldest first
        room = self.max_length - waiting[0].length
        rest = waiting[1:]
        while True:
            fits = [e for e in rest if e.length <= room]
            if not fits:
                break
            best = max(fits, key=lambda e: e.length)  # max keeps the first (oldest) of equals
            row.append(best)
            rest.remove(best)
            room -= best.length
        for e in row:
            e.placed = True
        self._drop_placed_prefix()
        return [e.sample for e in row]

    def get_state(self) -> dict[str, Any]:
        base = self._drawn[0].state_before if self._drawn else self.source.state_dict()
        return {PACKING_KEY: {"source": copy.deepcopy(base), "placed": [e.placed for e in self._drawn]}}


def collate_packed(rows: list[Row], *, pad_id: int, max_length: int) -> dict[str, torch.Tensor]:
    """Packed rows -> ``input_ids``, ``loss_mask`` ``[B, max_length]``, ``valid_lengths [B]`` (real
    tokens per row), ``document_ids [B, max_length]`` int32 (0, 1, ... per document; the padding
    tail one more than the last document) and ``documents [B]`` (conversations per row)."""
    bsz = len(rows)
    input_ids = torch.full((bsz, max_length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((bsz, max_length), dtype=torch.bool)
    document_ids = torch.empty((bsz, max_length), dtype=torch.int32)
    valid = []
    for i, row in enumerate(rows):
        at = 0
        for d, (ids, mask) in enumerate(row):
            n = len(ids)
            input_ids[i, at: at + n] = torch.tensor(ids, dtype=torch.long)
            loss_mask[i, at: at + n] = torch.tensor(mask, dtype=torch.bool)
            document_ids[i, at: at + n] = d
            at += n
        document_ids[i, at:] = len(row)
        valid.append(at)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "valid_lengths": torch.tensor(valid, dtype=torch.long),
        "document_ids": document_ids,
        "documents": torch.tensor([len(r) for r in rows], dtype=torch.long),
    }


def packed_counts(batch: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(conversations, real tokens)`` of a batch, packed or padded."""
    docs = batch.get("documents")
    samples = int(docs.sum()) if docs is not None else batch["input_ids"].shape[0]
    return samples, int(batch["valid_lengths"].sum())
