"""Rotary position embeddings (rotate-half convention of HF Qwen3 / Llama).

cos/sin are evaluated for explicit position ids ``[B, L]``. This is the same computation as
gathering rows of a precomputed ``[max_positions, head_dim]`` table (the angle is one fp32 product
``position * inv_freq``), but without a buffer: models are built on the meta device and
materialized with ``to_empty``, which would leave a table buffer uninitialized, and draft positions
(``anchor + slot``) may run past ``max_position_embeddings``.
"""

from __future__ import annotations

import torch


def rope_inv_freq(
    head_dim: int,
    theta: float,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[head_dim // 2]`` inverse frequencies ``theta ** (-2i / head_dim)`` (HF's formula)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(dtype) / head_dim
    return 1.0 / (theta**exponent)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for ``position_ids [B, L]`` -> two ``[B, L, head_dim]`` tensors.

    Angles are computed in ``dtype``: fp32 as in HF for fp32/bf16 models (pass fp64 only for
    float64 models, e.g. exact reference tests). The frequencies are duplicated along the last
    dim (``cat(freqs, freqs)``) to match :func:`rotate_half`.
    """
    inv_freq = rope_inv_freq(head_dim, theta, device=position_ids.device, dtype=dtype)
    freqs = position_ids.to(dtype)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, heads, L, head_dim]`` by ``cos/sin [B, L, head_dim]``.

    cos/sin are cast to ``x.dtype`` first, as HF does, so bf16 models match HF's numerics.
    """
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return x * cos + rotate_half(x) * sin
