"""The Qwen3-MoE feed-forward: a softmax router over stacked SwiGLU experts.

The experts' weights are stacked, ``[E, ...]`` per projection, so FSDP2 shards them along the
expert dim like any other tensor, and the forward is three grouped GEMMs over the tokens sorted
by expert (``torch._grouped_mm`` in bf16: one kernel per projection, whatever E is), never a
Python loop over experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``x [N, in]`` rows sorted by group times ``w [G, out, in]`` (a Linear's layout per group):
    rows ``ends[g - 1] .. ends[g] - 1`` go through ``w[g]``; ``[N, out]``.

    bf16 (the GPU target's dtype) runs ``torch._grouped_mm``, one kernel for all groups; it takes
    no other dtype (its compile-time shape check refuses them), so fp32/fp64 (CPU tests, fp32
    evals) pad every group to the largest one and run one ``bmm``: the same product, no loop."""
    if x.dtype == torch.bfloat16:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    return _padded_bmm(x, w, ends)


def _padded_bmm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    group = torch.repeat_interleave(torch.arange(w.shape[0], device=x.device), counts.long(), output_size=x.shape[0])
    slot = torch.arange(x.shape[0], device=x.device) - (ends - counts).long()[group]
    padded = x.new_zeros(w.shape[0], int(counts.max()), x.shape[1])
    padded[group, slot] = x
    return torch.bmm(padded, w.transpose(-2, -1))[group, slot]


class StackedExperts(nn.Module):
    """``E`` SwiGLU experts, HF's per-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` weights
    stacked along a leading expert dim."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``x [T, H]``, each token's ``experts [T, k]`` and router ``weights [T, k]``: the
        weighted sum of its experts' outputs, ``[T, H]``."""
        t, k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # a scatter, not bincount: its output size does not depend on the data (compile-friendly)
        counts = torch.zeros(self.gate_proj.shape[0], dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)
        rows = x[order // k]
        h = F.silu(grouped_mm(rows, self.gate_proj, ends)) * grouped_mm(rows, self.up_proj, ends)
        out = grouped_mm(h, self.down_proj, ends)
        # back to (token, slot) order, then a fixed-order weighted sum: deterministic, unlike an
        # index_add of the slots into the tokens
        out = torch.empty_like(out).index_copy_(0, order, out).view(t, k, -1)
        return (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)


class SparseMoE(nn.Module):
    """Router (``gate``, HF name ``mlp.gate``) and experts (HF ``mlp.experts.{e}.*``)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.experts = StackedExperts(num_experts, dim, hidden_dim)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> (``experts [T, k]``, ``weights [T, k]`` in x's dtype): the top-k of
        the softmax over all experts (fp32), renormalized to sum 1 iff ``norm_topk_prob``."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.route(flat)
        return self.experts(flat, experts, weights).view_as(x)
