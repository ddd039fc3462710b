"""Causal attention that stays inside each document of a packed row (the frozen target's capture
of packed rows): query ``q`` sees key ``kv`` iff ``starts[q] <= kv <= q``, ``starts`` being the
first position of ``q``'s document (``TargetFeatures.document_spans``). A packed document's
captured features are then those of the same document alone.

On CUDA the mask is a flex ``BlockMask`` whose tile tables come from each query's one interval of
keys (``document_mask.interval_tiles``, as the drafts' packed masks; never a dense ``[S, S]`` grid); on CPU the same ``mask_mod`` gives the dense boolean mask for
sdpa (the CPU attention rule: flex has no CPU backward, and one mask function serves both).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as TILE

from models.common.attention import AttentionMask, dense_mask_from_mask_mod, resolve_attention_backend
from models.common.document_mask import interval_tiles, packed_tile_error
from models.common.tile_mask import block_mask_from_tiles

__all__ = ["TILE", "build_causal_document_mask", "causal_document_mask_mod", "causal_document_tiles"]


def causal_document_mask_mod(starts: torch.Tensor):
    """flex ``mask_mod`` of causal attention within documents; ``starts [B, S]`` int64."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (kv_idx >= starts[b, q_idx])

    return mask_mod


def causal_document_tiles(starts: torch.Tensor, tile: int = TILE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` bool ``[B, 1, n, n]`` tile grids of the causal document mask over a row
    of ``S = n * tile`` positions: query ``q`` sees the one interval of keys ``[starts[q], q]``."""
    seq = starts.shape[1]
    q = torch.arange(seq, device=starts.device).expand_as(starts)
    return interval_tiles(starts.to(torch.long), q + 1, tile, seq // tile)


def build_causal_document_mask(starts: torch.Tensor, backend: str = "auto") -> AttentionMask:
    """The attention mask of a packed row batch for ``models.common.attention.attention``: a
    ``BlockMask`` for flex (CUDA; the row length must be a multiple of the 128-position tile) or
    a dense bool ``[B, 1, S, S]`` for sdpa (CPU)."""
    bsz, seq = starts.shape
    mask_mod = causal_document_mask_mod(starts)
    if resolve_attention_backend(backend, starts.device) == "sdpa":
        return dense_mask_from_mask_mod(mask_mod, bsz, seq, seq, starts.device)
    if seq % TILE:
        raise packed_tile_error("data.max_length", seq, TILE)
    partial, full = causal_document_tiles(starts, TILE)
    return block_mask_from_tiles(partial, full, tile=TILE, mask_mod=mask_mod, q_len=seq, kv_len=seq)
