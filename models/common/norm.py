"""RMSNorm with fp32 statistics (Qwen3 / Llama style)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, normalized in fp32 and cast back to ``x.dtype``.

    The weight is applied after the cast back, in the same order as HF's ``Qwen3RMSNorm``, so a
    bf16 target reproduces HF's bf16 numerics.

    Args:
        dim: size of the normalized (last) dimension.
        eps: added to the mean square before the reciprocal square root.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        # fp64 inputs (tests) keep fp64; bf16/fp16 are promoted to fp32 for the statistics.
        xf = x.to(torch.promote_types(dtype, torch.float32))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
