"""Synthetic token rows for benchmarks: ``data.source = "synthetic:<mode>"``.

Rows are made in memory and fed through the same torchdata pipeline (batcher, collate,
prefetcher, stateful loader) as conversations, so a benchmark runs exactly the code path of a
job. Modes (the seeds' synthetic data, SpecForge's ``--variable-mask`` harness):

- ``fixed``: every sample is ``data.max_length`` tokens, all of them in the loss;
- ``varmask``: every sample is ``data.max_length`` tokens; a random 20-80 % prefix is prompt
  (out of the loss), so the number of anchor candidates differs between samples;
- ``varlen``: lengths uniform in ``[max_length / 8, max_length]`` with the same 20-80 %
  prompt prefix (closer to chat data: pad-to-longest batches change shape).

``data.max_rows`` is the number of distinct rows per epoch (0: 1024); row ``i`` is drawn from
a generator seeded with ``(training.seed, i)``, so runs and resumes see the same rows. The
synthetic *target* (random captured features) is ``titan_draft/features/synthetic.py``.
"""

from __future__ import annotations

import functools
import json
import os

from typing import Any, Optional

import torch
import torchdata.nodes as tn

from titan_draft.data.sources.chat import STATE_KEY, Sample, check_saved_row_count, hashed_seed

__all__ = [
    "SYNTHETIC_MODES",
    "SYNTHETIC_PREFIX",
    "SyntheticSourceNode",
    "build_synthetic_source",
    "is_synthetic_source",
    "synthetic_sample",
]

SYNTHETIC_PREFIX = "synthetic:"
# first_exchange / conversation: lengths and loss-token counts drawn from the recorded ShareGPT
# lengths in lengths/ (scripts/length_histogram.py), truncated to max_length as real rows are
RECORDED_MODES = ("first_exchange", "conversation")
SYNTHETIC_MODES = ("fixed", "varmask", "varlen", *RECORDED_MODES)
DEFAULT_SYNTHETIC_ROWS = 1024
# The prompt share of a varmask/varlen sample (the seeds' "random 20-80 % prefix").
PROMPT_FRACTION = (0.2, 0.8)
# Ordinary Qwen3 BPE ids (the special tokens, the mask token among them, start at 151643).
_TOKEN_ID_LIMIT = 151643


def is_synthetic_source(source: str) -> bool:
    return source.startswith(SYNTHETIC_PREFIX)


def _synthetic_mode(source: str) -> str:
    mode = source[len(SYNTHETIC_PREFIX):]
    if mode not in SYNTHETIC_MODES:
        raise ValueError(
            f"data.source: {source!r} is not a synthetic source; use one of "
            f"{', '.join(SYNTHETIC_PREFIX + m for m in SYNTHETIC_MODES)}"
        )
    return mode


@functools.lru_cache(maxsize=None)
def recorded_lengths(mode: str) -> list[tuple[int, int]]:
    """``(tokens, loss tokens)`` of the rows recorded for a ``RECORDED_MODES`` mode."""
    path = os.path.join(os.path.dirname(__file__), "lengths", f"{mode}.json")
    with open(path) as f:
        return [tuple(pair) for pair in json.load(f)["lengths"]]


def synthetic_sample(mode: str, max_length: int, seed: int, row: int, vocab_limit: int = _TOKEN_ID_LIMIT) -> Sample:
    """Row ``row`` of a synthetic source: ``(input_ids, loss_mask)`` as plain lists."""
    g = torch.Generator().manual_seed(hashed_seed("titan_draft.synthetic", seed, row))
    length = max_length
    if mode in RECORDED_MODES:
        table = recorded_lengths(mode)
        total, loss = table[int(torch.randint(len(table), (1,), generator=g))]
        length = min(total, max_length)
        ids = torch.randint(0, vocab_limit, (length,), generator=g).tolist()
        # the answer ends the row; at least two supervised tokens remain after truncation
        prompt = min(total - loss, length - 2)
        return ids, [False] * prompt + [True] * (length - prompt)
    if mode == "varlen":
        low = max(2, max_length // 8)
        length = int(torch.randint(low, max_length + 1, (1,), generator=g))
    ids = torch.randint(0, vocab_limit, (length,), generator=g).tolist()
    if mode == "fixed":
        return ids, [True] * length
    lo, hi = PROMPT_FRACTION
    fraction = lo + (hi - lo) * float(torch.rand((), generator=g))
    # at least two supervised tokens remain, so every sample has an anchor candidate
    prompt = min(int(fraction * length), length - 2)
    return ids, [False] * prompt + [True] * (length - prompt)


class SyntheticSourceNode(tn.BaseNode[Sample]):
    """Yields this DP rank's synthetic rows, epoch after epoch, forever.

    Its state has the layout of ``ChatSourceNode``'s (epoch, position, skip counts, row count
    under ``STATE_KEY``), so ``ChatDataLoader`` reports and resumes it the same way.

    Args:
        mode: one of ``SYNTHETIC_MODES``.
        num_rows: distinct rows in the whole source (all DP ranks).
        max_length: tokens per sample (the longest sample with ``varlen``).
        seed: row seed (``training.seed``).
        dp_rank, dp_world: rows ``dp_rank, dp_rank + dp_world, ...`` belong to this rank.
    """

    def __init__(self, mode: str, *, num_rows: int, max_length: int, seed: int, dp_rank: int, dp_world: int):
        super().__init__()
        if mode not in SYNTHETIC_MODES:
            raise ValueError(f"synthetic mode {mode!r} is not one of {SYNTHETIC_MODES}")
        self.mode = mode
        self.max_length = max_length
        self.seed = seed
        self.rows = range(dp_rank, num_rows, dp_world)
        """Global indices of this rank's rows (``ChatDataLoader`` counts them)."""
        self._epoch = 0
        self._position = 0

    shuffle = False  # every epoch reads the rows in index order

    def epoch_order(self, num_rows: int, epoch: int) -> list[int]:
        """The order a rank of ``num_rows`` synthetic rows reads them in any epoch: index order."""
        return list(range(num_rows))

    def reset(self, initial_state: Optional[dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self._epoch, self._position = 0, 0
            return
        state = initial_state[STATE_KEY]
        check_saved_row_count(state, len(self.rows), "synthetic source", "data.max_rows")
        self._epoch, self._position = state["epoch"], state["position"]

    def next(self) -> Sample:
        row = self.rows[self._position]
        self._position += 1
        if self._position == len(self.rows):
            self._epoch, self._position = self._epoch + 1, 0
        # every epoch repeats the same rows, like a dataset read again
        return synthetic_sample(self.mode, self.max_length, self.seed, row)

    def usable_samples(self):
        """Every row once (a counting pass)."""
        for row in self.rows:
            yield synthetic_sample(self.mode, self.max_length, self.seed, row)

    def get_state(self) -> dict[str, Any]:
        return {
            STATE_KEY: {
                "epoch": self._epoch,
                "position": self._position,
                "skip_counts": {},
                "num_rows": len(self.rows),
            }
        }


def build_synthetic_source(data_cfg: Any, *, dp_rank: int, dp_world: int, seed: int) -> SyntheticSourceNode:
    """This DP rank's source for ``data.source = "synthetic:<mode>"``; ``build_dataloader`` puts
    the job's pipeline (batcher, collate, prefetcher, loader) after it, as after a chat source."""
    mode = _synthetic_mode(data_cfg.source)
    num_rows = data_cfg.max_rows or DEFAULT_SYNTHETIC_ROWS
    if num_rows < dp_world:
        raise ValueError(f"data.max_rows: {num_rows} synthetic rows leave some of the {dp_world} DP ranks with none")
    return SyntheticSourceNode(
        mode, num_rows=num_rows, max_length=data_cfg.max_length, seed=seed, dp_rank=dp_rank, dp_world=dp_world
    )
