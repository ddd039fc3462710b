"""Moving a row-source data position to another DP size: what is exact, and the refusal otherwise.

Rows are split rank-strided: of ``N`` rows, rank ``r`` of ``W`` owns rows ``r, r + W, ...`` and
reads them in an epoch order that depends only on its row count, the seed and the epoch
(``epoch_order``). A saved position is, per rank, "epoch ``e``, the first ``p`` rows of epoch
``e``'s order read". It is turned into a *read count* per source row: ``e + 1`` for those ``p``
rows, ``e`` for the rest of that rank's rows. That count is what a resume must keep exactly: no
row lost, none read twice.

A new rank ``r'`` of ``W'`` can continue exactly iff its rows' counts have the shape its own state
can express: every row read ``e'`` or ``e' + 1`` times, and the rows read ``e' + 1`` times are the
first ``p'`` of its epoch-``e'`` order. Then its state is ``(e', p')``. In practice:

- ``data.shuffle = false`` (source order): a DP size that is a multiple of the saved one (2 -> 4)
  always continues, since each new rank's rows are a subsequence, in the same order, of one saved
  rank's rows; a smaller one (4 -> 2) continues when the merged ranks stopped at positions that
  interleave (no rank skipped more unusable rows than its neighbours since the epoch began).
- ``data.shuffle = true``: a rank's order is a permutation of its own rows, so another split is
  expressible at an epoch boundary (nothing or everything of the new rank's rows read) and
  mid-epoch only by chance (the rows read happen to start the new rank's own order).

Otherwise the refusal says which rank and why. Which rows a step reads *after* the resume is
described in docs/reliability.md (the same global rows per step as the uninterrupted run when
the order is source order, no row is skipped and both DP sizes divide the row count).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["read_counts", "refusal", "reshard_position"]


def refusal(saved_world: int, new_world: int, why: str) -> ValueError:
    """The one line that refuses a DP change, with what to do instead."""
    return ValueError(
        f"data: the data position saved by {saved_world} DP ranks cannot be moved exactly to {new_world}: {why}; "
        f"resume with {saved_world} DP ranks, or set checkpoint.reset_data_position = true to keep the weights, "
        "optimizer and step and start the data afresh")


def read_counts(saved: list[dict[str, Any]], order: Callable[[int, int], list[int]]) -> torch.Tensor:
    """How many times the saved run had read each source row (index = global row)."""
    world = len(saved)
    total = sum(s["num_rows"] for s in saved)
    counts = torch.empty(total, dtype=torch.long)
    for r, s in enumerate(saved):
        n, epoch, position = s["num_rows"], s["epoch"], s["position"]
        mine = torch.full((n,), epoch, dtype=torch.long)
        mine[torch.tensor(order(n, epoch)[:position], dtype=torch.long)] += 1
        counts[r::world] = mine  # rank r's local row k is global row r + k * world
    return counts


def reshard_position(saved: list[dict[str, Any]], *, new_rank: int, new_world: int, num_rows: int,
                     order: Callable[[int, int], list[int]], shuffled: bool) -> tuple[int, int]:
    """``(epoch, position)`` for DP rank ``new_rank`` of ``new_world`` that continues the saved run.

    Args:
        saved: the source state (``epoch``, ``position``, ``num_rows``) of each saved DP rank, in
            rank order.
        num_rows: the rows this new rank owns (a check that the source is the same).
        order: ``order(num_rows, epoch)``: the epoch order of a rank with that many rows.
        shuffled: whether ``order`` is a shuffle (only for the refusal's reason).

    Raises:
        ValueError: one line naming the rank and why, when no state of this rank continues exactly.
    """
    world = len(saved)
    total = sum(s["num_rows"] for s in saved)
    split = [s["num_rows"] for s in saved]
    if split != [len(range(r, total, world)) for r in range(world)] or num_rows != len(
            range(new_rank, total, new_world)):
        raise ValueError(
            f"data: the dataloader states of {world} DP ranks were saved over {total} rows ({split} per rank) but "
            f"DP rank {new_rank} of {new_world} now has {num_rows} rows (data.source / data.max_rows changed?)")
    counts = read_counts(saved, order)[new_rank::new_world]
    epoch = int(counts.min())
    if int(counts.max()) > epoch + 1:
        raise refusal(world, new_world, (
            f"DP rank {new_rank}'s rows were read from {epoch} to {int(counts.max())} times by the saved run "
            "(its ranks were more than an epoch apart), which one epoch position cannot express"))
    ahead = counts > epoch
    position = int(ahead.sum())
    if not bool(ahead[torch.tensor(order(num_rows, epoch)[:position], dtype=torch.long)].all()):
        if shuffled:
            why = (f"with data.shuffle each rank reads its own rows in an order of its own, so mid-epoch the rows "
                   f"read in epoch {epoch} are not the start of DP rank {new_rank}'s order (with data.shuffle a DP "
                   "change is exact only at an epoch boundary)")
        else:
            why = (f"the rows read in epoch {epoch} are not the first rows of DP rank {new_rank}'s share in "
                   "source order (the merged saved ranks had skipped different numbers of unusable rows)")
        raise refusal(world, new_world, why)
    return epoch, position
