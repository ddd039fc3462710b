"""DFlash2's grouped dynamic depthwise convolution over the draft block stream."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupedDynamicConv(nn.Module):
    """Per-row depthwise conv whose kernel is ``base + delta(row)``, causal inside each block.

    One ``kernel_projection`` of the sublayer *input* gives the deltas of both sides: side 0
    convolves the sublayer input, side 1 its output. For row ``r`` (slot ``r mod b`` of its
    block) and channel ``c``::

        out[r, c] = sum_{tau < taps, tau <= r mod b}
                    (base[side, tau, c] + delta[r, side, tau, c // G]) * x[r - tau, c]

    so taps never reach into the previous block. The projection output is laid out as
    ``(side, tap, group)``. With ``base = identity`` (tap 0 = 1) and a zero projection the conv
    is exactly the identity, so DFlash2 starts as plain DFlash.

    Args:
        dim: channels H.
        taps: kernel length.
        group_size: G, channels sharing one delta (must divide ``dim``).
        block_size: rows per block b (rows are laid out block after block).
    """

    def __init__(self, dim: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        if dim % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size {dim}")
        self.taps = taps
        self.group_size = group_size
        self.block_size = block_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, dim))
        self.kernel_projection = nn.Linear(dim, 2 * taps * (dim // group_size), bias=False)

    def deltas(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, R, H]`` sublayer input -> ``[B, R, 2, taps, H // G]`` kernel deltas."""
        return self.kernel_projection(x).unflatten(-1, (2, self.taps, -1))

    def forward(self, x: torch.Tensor, deltas: torch.Tensor, side: int) -> torch.Tensor:
        """Convolve ``x [B, R, H]`` (R a multiple of block_size) with side ``side``'s kernel."""
        bsz, rows, dim = x.shape
        b, g = self.block_size, self.group_size
        # fp32 accumulation (fp64 stays fp64): the taps sum products of bf16 values.
        acc = torch.promote_types(x.dtype, torch.float32)
        xf = x.to(acc)
        blocks = xf.view(bsz, rows // b, b, dim)
        base = self.base_kernel[side].to(acc)
        delta = deltas[:, :, side].to(acc)  # [B, R, taps, H // G]
        out = torch.zeros_like(xf)
        for tau in range(min(self.taps, b)):
            # x[r - tau] inside the block, zeros for the first tau slots of every block
            shifted = F.pad(blocks[:, :, : b - tau], (0, 0, tau, 0)).view(bsz, rows, dim)
            grouped = shifted.view(bsz, rows, dim // g, g) * delta[:, :, tau, :, None]
            out = out + shifted * base[tau] + grouped.view(bsz, rows, dim)
        return out.to(x.dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.base_kernel.zero_()
        self.base_kernel[:, 0].fill_(1.0)
        nn.init.zeros_(self.kernel_projection.weight)
