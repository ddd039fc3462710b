"""flex ``BlockMask`` tables built from a mask's tile structure instead of a dense evaluation.

``create_block_mask`` evaluates the ``mask_mod`` on the whole dense ``[B, Q, KV]`` grid only to
learn which ``T x T`` tiles are empty, partial or full. Where that classification follows from
a few per-row numbers, it is computed here on the ``[B, 1, num_q_tiles, num_kv_tiles]`` tile
grid and handed to ``BlockMask.from_kv_blocks``. The ``mask_mod`` stays the one definition of
the mask: flex applies it inside the partial tiles, and the tile classes only have to agree
with it on which tiles those are. :func:`block_mask_from_tiles` is the shared last step (EAGLE-3's
``models/eagle3/block_mask.py`` uses it too).

The block-diffusion mask (``make_mask_mod`` in ``block_diffusion.py``): queries are the
``Q = N * b`` block rows (row ``q`` in block ``q // b``), keys are the ``S`` context positions
followed by the same ``N * b`` block rows. With ``S`` and ``Q`` multiples of the tile ``T``, no
key tile mixes context and block keys, and no tile is cut by a sequence end. For query tile
``qt`` (rows ``qt*T .. (qt+1)*T - 1``):

* context key tile ``kt`` (keys ``kt*T .. (kt+1)*T - 1``, all ``< S``): row ``q`` sees the
  prefix ``kv < e_q``, ``e_q`` = its block's anchor if the block is kept, else 0. Every row
  sees the whole tile iff ``min_q e_q >= (kt+1)*T`` (full); no row sees any of it iff
  ``max_q e_q <= kt*T`` (empty); otherwise partial. Nothing is assumed about the anchors'
  order, so this holds for any anchors and keep.
* block key tile ``kt = S/T + j`` (block rows ``j*T .. (j+1)*T - 1``): key ``r`` is seen by
  row ``q`` iff ``r // b == q // b``, whatever keep. The blocks a tile of rows touches form the
  interval ``[t*T // b, ((t+1)*T - 1) // b]``, so the tile is non-empty iff the query tile's
  and the key tile's intervals intersect, and full iff both are the same single block (only
  possible for ``b >= T``). Blocks straddling a tile edge (``b`` not dividing ``T``, as DSpark's
  7) make the neighbouring tiles partial, which the intervals capture.

Packed rows (``doc_starts``: each anchor's document start, ``make_mask_mod``'s): a row sees
the context keys ``[lo_q, e_q)``, ``lo_q`` its anchor's document start (kept blocks; nothing
otherwise). The rows of one query tile may lie in several documents, so the context tiles are
classed row by row (``models/common/document_mask.py``); the block keys are as above.

Anything else (``S`` or ``Q`` not a multiple of ``T``, ``T < 2``) goes through
``create_block_mask`` itself, never through a guess; packed rows are refused there instead (their
masks are never evaluated densely).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from models.common.document_mask import interval_tiles, packed_tile_error
from models.common.tile_mask import block_mask_from_tiles

__all__ = ["block_diffusion_block_mask", "block_diffusion_tile_classes"]


def _covered(context_len: int, q_len: int, tile: int) -> bool:
    return tile >= 2 and context_len % tile == 0 and q_len % tile == 0


def block_diffusion_tile_classes(
    anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int, tile: int = 128,
    doc_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)``: bool ``[B, 1, Q/T, (S + Q)/T]`` tile grids of the block-diffusion
    mask (``Q = N * block_size``) for ``anchors`` / ``keep`` ``[B, N]`` and, in packed rows,
    the anchors' document starts ``doc_starts [B, N]`` (module docstring). ``context_len`` and
    ``Q`` must be multiples of ``tile``."""
    bsz, n = anchors.shape
    q_len = n * block_size
    if not _covered(context_len, q_len, tile):
        raise ValueError(f"S {context_len}, Q {q_len} are not covered by the tile rules for tile {tile}")
    device = anchors.device
    nq, nc = q_len // tile, context_len // tile

    # Context keys: each row's visible prefix length, then its min / max over each query tile.
    # O(B * Q) work on the row grid, against create_block_mask's O(B * Q * KV).
    kept = keep.to(device=device, dtype=torch.bool)
    reach = torch.where(kept, anchors.to(torch.long), 0)
    if doc_starts is None:
        reach = reach.repeat_interleave(block_size, dim=1).view(bsz, nq, tile)
        lo_reach = reach.amin(dim=-1)[:, :, None]  # [B, nq, 1]
        hi_reach = reach.amax(dim=-1)[:, :, None]
        kt = torch.arange(nc, device=device).view(1, 1, nc)
        ctx_full = lo_reach >= (kt + 1) * tile
        ctx_partial = ~ctx_full & (hi_reach > kt * tile)
    else:  # each row sees [its document's start, its anchor): O(B * Q * S / T)
        first = torch.where(kept, doc_starts.to(device=device, dtype=torch.long), 0)
        ctx_partial, ctx_full = interval_tiles(first, reach, tile, nc, rows_each=block_size)
        ctx_partial, ctx_full = ctx_partial[:, 0], ctx_full[:, 0]

    # Block keys: the interval of blocks each tile of rows touches (the same for every sample).
    t = torch.arange(nq, device=device)
    first, last = (t * tile) // block_size, ((t + 1) * tile - 1) // block_size
    q_first, q_last = first.view(nq, 1), last.view(nq, 1)
    k_first, k_last = first.view(1, nq), last.view(1, nq)
    meet = (q_first <= k_last) & (k_first <= q_last)
    one_block = (q_first == q_last) & (k_first == k_last) & (q_first == k_first)
    blk_full = (meet & one_block).expand(bsz, nq, nq)
    blk_partial = (meet & ~one_block).expand(bsz, nq, nq)

    partial = torch.cat([ctx_partial, blk_partial], dim=-1)
    full = torch.cat([ctx_full, blk_full], dim=-1)
    return partial.unsqueeze(1), full.unsqueeze(1)


def block_diffusion_block_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_len: int,
    block_size: int,
    *,
    mask_mod,
    tile: int = 128,
    doc_starts: torch.Tensor | None = None,
) -> BlockMask:
    """The ``BlockMask`` of the block-diffusion mask (queries: the ``N * block_size`` block rows;
    keys: ``context_len`` context positions, then the block rows) for ``anchors`` / ``keep``
    ``[B, N]`` (and, packed, the anchors' document starts ``doc_starts``), on ``anchors``'
    device, with ``tile x tile`` sparse blocks. ``mask_mod`` must be ``make_mask_mod(anchors,
    keep, context_len, block_size, doc_starts)``: flex applies it inside the partial tiles, and
    it is what the fallback evaluates."""
    bsz, n = anchors.shape
    q_len = n * block_size
    kv_len = context_len + q_len
    if doc_starts is not None and not _covered(context_len, q_len, tile):
        if context_len % tile:
            raise packed_tile_error("data.max_length", context_len, tile)
        raise packed_tile_error("model.args.num_anchors * block_size", q_len, tile)
    if not _covered(context_len, q_len, tile):
        # Not covered by the tile rules: a last tile cut short by a sequence end (S or Q not a
        # multiple of the tile; create_block_mask counts the padding outside the sequence as
        # masked, and a context tile running into the block keys mixes both rules), or T = 1,
        # where the tile grid is the dense grid anyway and nothing would be saved. Evaluate the
        # mask densely, as create_block_mask does.
        return create_block_mask(mask_mod, bsz, None, q_len, kv_len, device=anchors.device, BLOCK_SIZE=tile)
    partial, full = block_diffusion_tile_classes(anchors, keep, context_len, block_size, tile, doc_starts)
    return block_mask_from_tiles(partial, full, tile=tile, mask_mod=mask_mod, q_len=q_len, kv_len=kv_len)
