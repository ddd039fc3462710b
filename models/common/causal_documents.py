"""Causal attention that stays inside each document of a packed row (the frozen target's capture
of packed rows): query ``q`` sees key ``kv`` iff ``starts[q] <= kv <= q``, ``starts`` being the
first position of ``q``'s document (``TargetFeatures.document_spans``). A packed document's
captured features are then those of the same document alone.

On CUDA the mask is a flex ``BlockMask`` whose tile tables come from the per-tile ``starts``
(never a dense ``[S, S]`` grid); on CPU the same ``mask_mod`` gives the dense boolean mask for
sdpa (the CPU attention rule: flex has no CPU backward, and one mask function serves both).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as TILE

from models.common.attention import AttentionMask, dense_mask_from_mask_mod, resolve_attention_backend
from models.common.tile_mask import block_mask_from_tiles

__all__ = ["TILE", "build_causal_document_mask", "causal_document_mask_mod", "causal_document_tiles"]


def causal_document_mask_mod(starts: torch.Tensor):
    """flex ``mask_mod`` of causal attention within documents; ``starts [B, S]`` int64."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= starts[b, q_idx])

    return mask_mod


def causal_document_tiles(starts: torch.Tensor, tile: int = TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` bool ``[B, 1, n, n]`` tile grids of the causal document mask over a row
    of ``S = n * tile`` positions.

    ``starts`` never decreases along a row and ``q`` sees the keys ``[starts[q], q]``, so within a
    query tile ``[q0, q1]`` the widest window belongs to its last query: a key tile ``[k0, k1]``
    is visible at all iff ``k0 <= q1`` and the first query at or after ``k0`` starts its document
    at or before ``k1``; every pair is visible iff ``k1 <= q0`` and ``starts[q1] <= k0``.
    """
    bsz, seq = starts.shape
    n = seq // tile
    lo = torch.arange(n, device=starts.device) * tile  # tile's first position
    hi = lo + tile - 1
    q0, q1 = lo.view(1, n, 1), hi.view(1, n, 1)
    k0, k1 = lo.view(1, 1, n), hi.view(1, 1, n)
    first_seen = torch.maximum(q0, k0).expand(bsz, n, n).clamp(max=seq - 1)
    start_at = starts.gather(1, first_seen.reshape(bsz, -1)).view(bsz, n, n)
    any_visible = (k0 <= q1) & (start_at <= k1)
    last_start = starts[:, hi].view(bsz, n, 1)
    full = (k1 <= q0) & (last_start <= k0)
    return (any_visible & ~full)[:, None], full.expand(bsz, n, n)[:, None]


def build_causal_document_mask(starts: torch.Tensor, backend: str = "auto") -> AttentionMask:
    """The attention mask of a packed row batch for ``models.common.attention.attention``: a
    ``BlockMask`` for flex (CUDA; the row length must be a multiple of the 128-position tile) or
    a dense bool ``[B, 1, S, S]`` for sdpa (CPU)."""
    bsz, seq = starts.shape
    mask_mod = causal_document_mask_mod(starts)
    if resolve_attention_backend(backend, starts.device) == "sdpa":
        return dense_mask_from_mask_mod(mask_mod, bsz, seq, seq, starts.device)
    if seq % TILE:
        raise ValueError(f"packed rows of {seq} positions: flex attention over packed documents needs "
                         f"data.max_length to be a multiple of {TILE}")
    partial, full = causal_document_tiles(starts, TILE)
    return block_mask_from_tiles(partial, full, tile=TILE, mask_mod=mask_mod, q_len=seq, kv_len=seq)
