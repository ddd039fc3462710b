"""Moving a feature-cache data position to another DP size (the offline twin of data/reshard.py).

Shard ``j`` (file-name order) belongs to rank ``j % W``; a rank visits its shards in an epoch order
that depends on its shard count, the seed and the epoch, and each shard's rows in an order that
depends on the file and the epoch only. A saved position "epoch ``e``, ``s`` shards of epoch
``e``'s order done, ``p`` rows of the next one read" is turned into a read count per row of every
shard, and a new rank continues exactly iff its shards' counts have the shape of its own state:
every row read ``e'`` or ``e' + 1`` times, the shards read ``e' + 1`` times are the first of its
epoch-``e'`` shard order, then at most one shard read in part (the first rows of its epoch-``e'``
row order), then shards not read this epoch. No row is then lost or read twice.

With ``data.shuffle = false`` this holds for any DP size that is a multiple of the saved one (each
new rank's shards are a subsequence of one saved rank's, in the same order); with the shuffle, at
epoch boundaries (and by chance otherwise). Because ranks read whole shards, the global order of
the samples is not the one of the saved run even then; only the no-loss, no-repeat count holds.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from titan_draft.data.reshard import refusal

__all__ = ["reshard_feature_position"]


def _read_counts(saved: list[dict[str, Any]], rows: dict[str, int], shard_order: Callable[[int, int], list[int]],
                 row_order: Callable[[str, int, int], list[int]]) -> dict[str, torch.Tensor]:
    counts: dict[str, torch.Tensor] = {}
    for state in saved:
        files, epoch, done, part = state["files"], state["epoch"], state["shard_pos"], state["row_pos"]
        for i, j in enumerate(shard_order(len(files), epoch)):
            f = files[j]
            counts[f] = torch.full((rows[f],), epoch + (1 if i < done else 0), dtype=torch.long)
            if i == done and part:
                counts[f][torch.tensor(row_order(f, rows[f], epoch)[:part], dtype=torch.long)] += 1
    return counts


def reshard_feature_position(saved: list[dict[str, Any]], saved_files: list[list[str]], new_files: list[str],
                             rows: dict[str, int], *, new_rank: int, new_world: int,
                             shard_order: Callable[[int, int], list[int]],
                             row_order: Callable[[str, int, int], list[int]], shuffled: bool) -> tuple[int, int, int]:
    """``(epoch, shard_pos, row_pos)`` for DP rank ``new_rank`` of ``new_world``.

    Args:
        saved: each saved rank's ``FeatureShardNode`` state, in rank order.
        saved_files: the shard files each saved rank reads by the manifest (a check that the
            cache is the same); ``new_files``: the new rank's.
        rows: rows per shard file (the manifest).
        shard_order, row_order: the node's orders (``FeatureShardNode.shard_order`` / ``row_order``).
        shuffled: whether the orders are shuffles (only for the refusal's reason).

    Raises:
        ValueError: one line naming the rank and why, when no state of this rank continues exactly.
    """
    world = len(saved)
    for r, state in enumerate(saved):
        if state["files"] != saved_files[r]:
            raise ValueError(f"data: the dataloader state of DP rank {r} of {world} was saved over feature shards "
                             f"{state['files'][:3]}... but that rank would now read {saved_files[r][:3]}...: "
                             "data.feature_cache changed?")
    counts = _read_counts(saved, rows, shard_order, row_order)
    mine = new_files
    every = torch.cat([counts[f] for f in mine])
    epoch = int(every.min())
    if int(every.max()) > epoch + 1:
        raise refusal(world, new_world, (
            f"DP rank {new_rank}'s shards were read from {epoch} to {int(every.max())} times by the saved run "
            "(its ranks were more than an epoch apart), which one epoch position cannot express"))
    order = [mine[j] for j in shard_order(len(mine), epoch)]
    done = 0
    while bool((counts[order[done]] > epoch).all()):
        done += 1  # stops before the end: some row is read only `epoch` times
    ahead = counts[order[done]] > epoch
    part = int(ahead.sum())
    rest_untouched = all(not bool((counts[f] > epoch).any()) for f in order[done + 1:])
    prefix = bool(ahead[torch.tensor(row_order(order[done], rows[order[done]], epoch)[:part], dtype=torch.long)].all())
    if not (rest_untouched and prefix):
        why = (f"with data.shuffle each rank visits its own shards in an order of its own, so mid-epoch the shards "
               f"read in epoch {epoch} are not the start of DP rank {new_rank}'s order (with data.shuffle a DP change "
               "is exact only at an epoch boundary)" if shuffled else
               f"the shards read in epoch {epoch} are not the first of DP rank {new_rank}'s shards in file order "
               "(the merged saved ranks had read different numbers of rows)")
        raise refusal(world, new_world, why)
    return epoch, done, part
