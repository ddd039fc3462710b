"""The flex ``BlockMask`` of EAGLE-3's training-time-test step, built from its block structure.

``create_block_mask`` evaluates the ``mask_mod`` on the whole dense ``[B, Q, KV]`` grid (at
S 2048 and step 6, 2 x 2048 x 14336 elements) only to learn which tiles are empty, partial or
full. For the TTT mask (see ``ttt_mask_mod`` in ``objective.py``) that classification follows
from the tile coordinates and each sample's valid length alone, so it is computed here on the
``[B, num_q_blocks, num_kv_blocks]`` tile grid instead and handed to ``BlockMask.from_kv_blocks``.
The ``mask_mod`` stays the one definition of the mask: flex applies it inside the partial tiles,
and the analytic classification only has to agree with it on which tiles those are.

Tile rules for query tile ``qb`` (``bs`` = block size, ``nb = S / bs``, ``L`` = the sample's
valid length clamped to ``[0, S]``), against the keys of step 0 at tile ``kb`` (positions
``kb*bs .. (kb+1)*bs - 1``), allowed where ``s <= q`` and ``s < L``:

* ``kb > qb``: every key is after every query: empty.
* ``kb < qb``: every key is before every query, so only ``s < L`` decides: full when
  ``(kb+1)*bs <= L``, empty when ``kb*bs >= L``, partial in between (``L`` inside the tile).
* ``kb == qb``: the diagonal tile is triangular (never full for ``bs > 1``): partial when its
  first key is inside the sequence (``kb*bs < L``), otherwise empty. Queries past ``L`` still
  see the step-0 keys before ``L``, which these rules keep (they do not look at ``q < L``).

Against step ``j >= 1`` (keys ``j*S + s``, allowed only at ``s == q``, whatever ``L``): only the
tile ``j*nb + qb`` is non-empty, and it is partial (its diagonal).

Packed rows (``starts``: each position's document start): step 0 allows ``starts[q] <= s <=
q``, one interval of keys per query, classed row by row (``models/common/document_mask.py``);
the later steps' diagonal tiles are as above.

Anything these rules do not cover (``S`` not a multiple of the block size, a block size below
2) goes through ``create_block_mask`` instead; packed rows are refused there (their masks are
never evaluated densely).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from models.common.document_mask import interval_tiles, packed_tile_error
from models.common.tile_mask import block_mask_from_tiles


def _covered(seq_len: int, block_size: int) -> bool:
    return block_size >= 2 and seq_len % block_size == 0


def ttt_tile_classes(
    seq_len: int, valid_lengths: torch.Tensor, step: int, block_size: int, starts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)``: bool ``[B, 1, nb, (step + 1) * nb]`` tile grids of step ``step``
    (``nb = seq_len // block_size``; ``seq_len`` must be a multiple of ``block_size``);
    ``starts [B, S]``: the positions' document starts in packed rows."""
    if not _covered(seq_len, block_size):
        raise ValueError(f"seq_len {seq_len} is not covered by the tile rules for block {block_size}")
    device = valid_lengths.device
    nb = seq_len // block_size
    length = valid_lengths.to(device=device, dtype=torch.long).clamp(0, seq_len).view(-1, 1, 1)
    qb = torch.arange(nb, device=device).view(1, nb, 1)
    kb = torch.arange(nb, device=device).view(1, 1, nb)
    if starts is None:
        lo, hi = kb * block_size, (kb + 1) * block_size  # the tile's first key and one past its last
        below = kb < qb
        full0 = below & (hi <= length)
        partial0 = ((kb == qb) & (lo < length)) | (below & (lo < length) & (length < hi))
    else:  # query q sees the step-0 keys [starts[q], q + 1)
        q = torch.arange(seq_len, device=device).expand(length.shape[0], seq_len)
        partial0, full0 = interval_tiles(starts.to(device=device, dtype=torch.long), q + 1, block_size, nb)
        partial0, full0 = partial0[:, 0], full0[:, 0]
    bsz = length.shape[0]
    diag = (kb == qb).expand(bsz, nb, nb)
    partial = torch.cat([partial0] + [diag] * step, dim=-1)
    full = torch.cat([full0] + [torch.zeros_like(diag)] * step, dim=-1)
    return partial.unsqueeze(1), full.unsqueeze(1)


def ttt_block_mask(
    seq_len: int,
    valid_lengths: torch.Tensor,
    step: int,
    *,
    mask_mod,
    block_size: int = 128,
    starts: torch.Tensor | None = None,
) -> BlockMask:
    """The ``BlockMask`` of TTT step ``step`` (queries: the ``seq_len`` positions; keys: steps
    ``0..step``, ``KV_LEN = (step + 1) * seq_len``) for ``B = len(valid_lengths)`` samples, on
    ``valid_lengths``' device. ``mask_mod`` must be ``ttt_mask_mod(seq_len, valid_lengths,
    starts)``: it is applied inside the partial tiles and is what the fallback evaluates."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    bsz = valid_lengths.shape[0]
    q_len, kv_len = seq_len, (step + 1) * seq_len
    if starts is not None and not _covered(seq_len, block_size):
        raise packed_tile_error("data.max_length", seq_len, block_size)
    if not _covered(seq_len, block_size):
        # Not covered by the tile rules (a last tile cut short by the sequence end, or 1x1
        # tiles whose diagonal is full): evaluate the mask densely, as flex itself does.
        return create_block_mask(mask_mod, bsz, None, q_len, kv_len, device=valid_lengths.device,
                                 BLOCK_SIZE=block_size)
    partial, full = ttt_tile_classes(seq_len, valid_lengths, step, block_size, starts)
    return block_mask_from_tiles(partial, full, tile=block_size, mask_mod=mask_mod, q_len=q_len, kv_len=kv_len)
