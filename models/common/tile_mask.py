"""flex ``BlockMask`` tables from a mask's tile classes (partial / full tiles), computed from a few
per-row numbers instead of evaluating the ``mask_mod`` on the dense grid: the shared last step of
the block-diffusion mask (``models/block_diffusion/mask.py``) and EAGLE-3's
(``models/eagle3/block_mask.py``)."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

__all__ = ["block_mask_from_tiles", "ordered_tiles"]


def ordered_tiles(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[B, 1, nq, nkv]`` 0/1 tile grid -> ``(num_blocks [B, 1, nq], indices [B, 1, nq, nkv])``
    int32: each row's marked tiles first in ascending order, then the unmarked ones (what
    ``create_block_mask`` produces, a stable descending sort of the row)."""
    blocks = blocks.to(torch.int32)
    num = blocks.sum(dim=-1, dtype=torch.int32)
    idx = torch.argsort(blocks, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def block_mask_from_tiles(partial: torch.Tensor, full: torch.Tensor, *, tile: int, mask_mod, q_len: int,
                          kv_len: int) -> BlockMask:
    """The ``BlockMask`` of bool ``[B, 1, nq, nkv]`` partial / full tile grids (``mask_mod``
    applied inside the partial tiles), through the public ``BlockMask.from_kv_blocks``."""
    kv_num, kv_idx = ordered_tiles(partial)
    full_num, full_idx = ordered_tiles(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=tile, mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len))
