"""The pipeline's source node: this DP rank's rows -> ``(input_ids, loss_mask)`` samples.

Everything that decides which row comes next lives in this node's small state (epoch, position,
skip counts); the permutation is recomputed from ``(seed, epoch)`` on resume rather than stored.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable, Optional

import torch
import torchdata.nodes as tn

from titan_draft.data.chat.template import render_chat
from titan_draft.data.sources.render_pool import rendered_in_order
from titan_draft.data.sources.rows import normalize_row
from titan_draft.data.tokenizer import Tokenizer
from titan_draft.data.worker_errors import row_error

__all__ = ["ChatSourceNode", "Sample", "STATE_KEY", "epoch_order"]

logger = logging.getLogger(__name__)

Sample = tuple[list[int], list[bool]]

# Key that marks this node's state inside the nested Loader state (see loader_state.find_source_state).
STATE_KEY = "chat_source"


def hashed_seed(namespace: str, seed: int, index: int) -> int:
    """A generator seed for item ``index`` (an epoch, a row) of a run seeded ``seed``.

    A real hash, not seed + index: neighbouring seeds must not replay each other's epochs or rows,
    and ``namespace`` keeps the streams of different users apart."""
    digest = hashlib.sha256(f"{namespace}:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def epoch_order(num_rows: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The order in which a rank of ``num_rows`` rows reads them in ``epoch``: a permutation seeded
    by ``(seed, epoch)``, or source order. A function of the row count, not of the rank, so a DP
    change can recompute the order any rank, old or new, reads (data/reshard.py)."""
    if not shuffle:
        return list(range(num_rows))
    g = torch.Generator().manual_seed(hashed_seed("titan_draft.data", seed, epoch))
    return torch.randperm(num_rows, generator=g).tolist()


def check_saved_row_count(state: dict[str, Any], num_rows: int, source: str, hint: str) -> None:
    """Refuse a source state saved over another number of rows on this DP rank: positions index
    this many rows, so any other count would resume somewhere else."""
    if state["num_rows"] != num_rows:
        raise ValueError(
            f"data: the dataloader state was saved with {state['num_rows']} rows on this DP "
            f"rank but the {source} now gives {num_rows} ({hint} changed?)"
        )


class ChatSourceNode(tn.BaseNode[Sample]):
    """Yields ``(input_ids, loss_mask)`` of this rank's rows, epoch after epoch, forever.

    Args:
        rows: this DP rank's raw rows (``load_rows``).
        tokenizer: the target's tokenizer.
        chat: the run's ``ChatFormat`` (template, system prompt, thinking, last turn only).
        max_length: tokens kept per sample (longer samples are truncated).
        seed: shuffle seed (``training.seed``).
        shuffle: permute the rows each epoch; otherwise read them in source order.
        reserved_ids: token ids a usable row must not contain (a draft's mask token: a real
            special token where the target has no spare embedding row).
        describe_row: names row ``i`` of ``rows`` in an error (e.g. its row number in the source).
        warn_below_rows: an epoch with fewer usable rows than this is warned about (0: never).

    Unusable rows are skipped and counted per reason, over the whole run (``skip_counts``: a bad
    row is counted again each time it comes round) and in the current epoch
    (``epoch_skip_counts``); each finished epoch is logged with its own counts.
    """

    def __init__(
        self,
        rows: list[Any],
        tokenizer: Tokenizer,
        *,
        chat: Any,
        max_length: int,
        seed: int,
        shuffle: bool,
        reserved_ids: frozenset[int] = frozenset(),
        describe_row: Callable[[int], str] = lambda i: f"row {i} of this DP rank",
        warn_below_rows: int = 0,
    ):
        super().__init__()
        self.warn_below_rows = warn_below_rows
        self._epoch_skips: dict[str, int] = {}
        self._epoch_usable = 0
        self.describe_row = describe_row
        self.reserved_ids = frozenset(reserved_ids)
        self.rows = rows
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_length = max_length
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._skip_counts: dict[str, int] = {}
        self._order: list[int] = []

    def _set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._order = self.epoch_order(len(self.rows), epoch)

    def epoch_order(self, num_rows: int, epoch: int) -> list[int]:
        """The order a rank of ``num_rows`` rows of this source reads them in ``epoch``."""
        return epoch_order(num_rows, self.seed, epoch, self.shuffle)

    def reset(self, initial_state: Optional[dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self._set_epoch(0)
            self._position = 0
            self._skip_counts = {}
            self._epoch_skips, self._epoch_usable = {}, 0
            return
        state = initial_state[STATE_KEY]
        check_saved_row_count(state, len(self.rows), "source", "data.source / data.max_rows")
        self._set_epoch(state["epoch"])
        self._position = state["position"]
        self._skip_counts = dict(state["skip_counts"])
        # absent in states saved before per-epoch counts existed
        self._epoch_skips = dict(state.get("epoch_skip_counts", {}))
        self._epoch_usable = state.get("epoch_usable", 0)

    def _skip(self, reason: str) -> None:
        self._skip_counts[reason] = self._skip_counts.get(reason, 0) + 1
        self._epoch_skips[reason] = self._epoch_skips.get(reason, 0) + 1

    def _end_epoch(self) -> None:
        skipped = {k: v for k, v in self._epoch_skips.items() if v}
        logger.info("data: epoch %d done: %d of %d rows usable%s", self._epoch, self._epoch_usable,
                    len(self.rows), f", skipped {skipped}" if skipped else "")
        if self._epoch_usable < self.warn_below_rows:
            logger.warning(
                "data: epoch %d had only %d usable rows on this DP rank, fewer than 10 optimizer steps' "
                "worth (%d): the draft sees the same few rows over and over; add data or train fewer steps",
                self._epoch, self._epoch_usable, self.warn_below_rows)
        self._epoch_skips, self._epoch_usable = {}, 0
        # Roll over now so that the state always names the epoch of the next row.
        self._set_epoch(self._epoch + 1)
        self._position = 0

    def _sample(self, row: Any) -> Sample | str:
        turns = normalize_row(row)
        if isinstance(turns, str):
            return turns
        chat = self.chat
        ids, mask = render_chat(turns, self.tokenizer, chat.template, chat.system_prompt,
                                enable_thinking=chat.enable_thinking, last_turn_only=chat.last_turn_only)
        if not self.reserved_ids.isdisjoint(ids):
            return "reserved_token"
        ids, mask = ids[: self.max_length], mask[: self.max_length]
        if not any(mask):
            return "no_loss_tokens"
        return ids, mask

    def sample_or_reason(self, row: Any) -> Sample | str:
        """``row`` as a sample, or the reason it is skipped (a ``SKIP_REASONS`` name)."""
        return self._sample(row)

    def usable_samples(self, workers: int = 1, chunk_rows: int = 512):
        """Every usable row once, in source order (a counting pass; the node's state is untouched),
        rendered by ``workers`` forked processes where the rows are many (``render_pool.py``)."""
        for sample in rendered_in_order(self, workers, chunk_rows):
            if not isinstance(sample, str):
                yield sample

    def next(self) -> Sample:
        for _ in range(len(self.rows)):
            index = self._order[self._position]
            try:
                sample = self._sample(self.rows[index])
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # e.g. a Rust tokenizer panic: name the row, never hang
                raise row_error(e, self.describe_row(index)) from e
            if isinstance(sample, str):
                self._skip(sample)
            else:
                self._epoch_usable += 1
            self._position += 1
            if self._position == len(self.rows):
                self._end_epoch()
            if not isinstance(sample, str):
                return sample
        # A whole pass without one usable row would otherwise spin forever.
        raise ValueError(
            f"data.source: none of this DP rank's {len(self.rows)} rows is usable "
            f"(skipped: {self._skip_counts})"
        )

    def get_state(self) -> dict[str, Any]:
        # Copies: the Prefetcher keeps this snapshot while the node runs ahead in its thread.
        return {
            STATE_KEY: {
                "epoch": self._epoch,
                "position": self._position,
                "skip_counts": dict(self._skip_counts),
                "epoch_skip_counts": dict(self._epoch_skips),
                "epoch_usable": self._epoch_usable,
                "num_rows": len(self.rows),
            }
        }
