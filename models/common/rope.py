"""Rotary position embeddings (rotate-half convention of HF Qwen3 / Llama).

cos/sin are evaluated for explicit position ids ``[B, L]``. This is the same computation as
gathering rows of a precomputed ``[max_positions, head_dim]`` table (the angle is one fp32 product
``position * inv_freq``), but without a buffer: models are built on the meta device and
materialized with ``to_empty``, which would leave a table buffer uninitialized, and draft positions
(``anchor + slot``) may run past ``max_position_embeddings``.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(
    head_dim: int,
    theta: float,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    scaling: dict | None = None,
) -> torch.Tensor:
    """``[head_dim // 2]`` inverse frequencies ``theta ** (-2i / head_dim)`` (HF's formula),
    optionally rescaled by a ``rope_scaling`` dict of HF's config (``rope_type`` llama3)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(dtype) / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling:
        inv_freq = _scale_inv_freq(inv_freq, scaling)
    return inv_freq


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1 frequency scaling: long wavelengths are divided by ``factor``, short ones kept,
    and the band between ``low_freq_factor`` and ``high_freq_factor`` interpolated smoothly."""
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind != "llama3":
        raise ValueError(f"rope_scaling: unsupported rope_type {kind!r} (supported: llama3, default)")
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(
    position_ids: torch.Tensor,
    head_dim: int,
    theta: float,
    dtype: torch.dtype = torch.float32,
    scaling: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for ``position_ids [B, L]`` -> two ``[B, L, head_dim]`` tensors.

    Angles are computed in ``dtype``: fp32 as in HF for fp32/bf16 models (pass fp64 only for
    float64 models, e.g. exact reference tests). The frequencies are duplicated along the last
    dim (``cat(freqs, freqs)``) to match :func:`rotate_half`.
    """
    inv_freq = rope_inv_freq(head_dim, theta, device=position_ids.device, dtype=dtype, scaling=scaling)
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
