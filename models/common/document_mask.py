"""Tile classes of a mask in which every query row sees one interval of keys, as the drafts' masks
over packed rows do (a row's keys stop at its document's start and end).

A query row ``q`` that sees exactly the keys ``[lo_q, hi_q)`` of a run of key positions sees
some of key tile ``[k0, k1)`` iff ``lo_q < k1``, ``hi_q > k0`` and ``lo_q < hi_q``, and all of
it iff ``lo_q <= k0`` and ``hi_q >= k1``. A tile of queries is FULL for a key tile when every
row sees all of it, PARTIAL when some row sees some of it, and skipped otherwise.

The classes are counted interval by interval (each a row, or a block's rows), ``O(M * KV / T)``
for ``M`` intervals, not taken from one ``[min lo, max hi)`` hull per query tile: the rows of one
tile may belong to different documents, whose intervals leave gaps, and a key tile inside a gap
would then be called partial though no row sees it (flex would compute it for nothing, and the
tables would differ from ``create_block_mask``'s). Nothing of size ``[Q, KV]`` is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["interval_tiles", "packed_tile_error"]


def interval_tiles(lo: torch.Tensor, hi: torch.Tensor, tile: int, kv_tiles: int,
                   rows_each: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` bool ``[B, 1, Q / tile, kv_tiles]`` for query rows that see the keys
    ``[lo, hi)`` (``lo``, ``hi``: ``[B, M]`` int64, each interval holding for ``rows_each``
    consecutive rows, ``Q = M * rows_each`` a multiple of ``tile``; the key positions are
    ``0 .. kv_tiles * tile - 1``). An empty interval (``lo >= hi``) sees nothing."""
    q_len = lo.shape[1] * rows_each
    if q_len % tile:
        raise ValueError(f"interval_tiles: {q_len} query rows are not a multiple of the tile {tile}")
    k0 = torch.arange(kv_tiles, device=lo.device) * tile
    k1 = k0 + tile
    lo, hi = lo[:, :, None], hi[:, :, None]
    some = (lo < k1) & (hi > k0) & (lo < hi)  # [B, M, kv_tiles]
    every = (lo <= k0) & (hi >= k1)
    # The intervals a tile of rows meets are a run first..last of them: count its intervals that
    # see some / all of each key tile from running sums, O(B * M * kv_tiles) with no row grid.
    t = torch.arange(q_len // tile, device=lo.device)
    first, last = (t * tile) // rows_each, ((t + 1) * tile - 1) // rows_each

    def count(x):
        run = F.pad(x.to(torch.int32).cumsum(dim=1), (0, 0, 1, 0))
        return run[:, last + 1] - run[:, first]  # [B, nq, kv_tiles]

    some = count(some) > 0
    every = count(every) == (last - first + 1)[None, :, None]
    return (some & ~every)[:, None], every[:, None]


def packed_tile_error(what: str, length: int, tile: int) -> ValueError:
    """The one line that refuses packed rows whose shape the tile rules do not cover (flex over
    packed documents is built from the tile classes alone, never from a dense evaluation)."""
    return ValueError(f"packed rows: flex attention over packed documents needs {what} to be a multiple of "
                      f"the {tile}-position tile, got {length}")
