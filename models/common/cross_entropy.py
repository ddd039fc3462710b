"""Chunked cross-entropy through a frozen vocabulary projection.

``[N, V]`` logits over a 152k vocabulary are the largest tensor of a DFlash step (8k rows ->
~5 GB in fp32), so they are produced ``chunk_rows`` rows at a time, reduced to per-row statistics
at once, and recomputed chunk by chunk in backward. Nothing of size ``[N, V]`` is ever alive or
saved for backward. The projection weight is frozen (a target's lm_head) and gets no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ChunkedCEOutput:
    ce: torch.Tensor
    """[N] per-row cross-entropy in fp32 (fp64 for fp64 inputs); 0 where the label is < 0.
    Differentiable with respect to ``hidden``."""
    argmax: torch.Tensor
    """[N] int64 argmax of the logits."""
    topk_values: torch.Tensor
    """[N, K] the K largest logits per row, descending (K = 0 when not asked); differentiable."""
    topk_indices: torch.Tensor
    """[N, K] int64 vocabulary ids of ``topk_values``."""


def _transform(z: torch.Tensor, logit_scale: float, softcap: float) -> torch.Tensor:
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap > 0.0:
        z = softcap * torch.tanh(z / softcap)
    return z


class _ChunkedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows, top_k, logit_scale, softcap):
        n = hidden.shape[0]
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
        ce = torch.empty(n, dtype=acc_dtype, device=hidden.device)
        lse = torch.empty(n, dtype=acc_dtype, device=hidden.device)
        argmax = torch.empty(n, dtype=torch.long, device=hidden.device)
        topv = torch.empty(n, top_k, dtype=acc_dtype, device=hidden.device)
        topi = torch.empty(n, top_k, dtype=torch.long, device=hidden.device)
        for s in range(0, n, chunk_rows):
            e = min(s + chunk_rows, n)
            u = _logits(hidden[s:e], weight, acc_dtype, logit_scale, softcap)
            lab = labels[s:e]
            lse[s:e] = torch.logsumexp(u, dim=-1)
            gold = u.gather(1, lab.clamp(min=0).unsqueeze(1)).squeeze(1)
            ce[s:e] = torch.where(lab >= 0, lse[s:e] - gold, torch.zeros_like(gold))
            argmax[s:e] = u.argmax(dim=-1)
            if top_k > 0:
                v, i = u.topk(top_k, dim=-1)
                topv[s:e] = v
                topi[s:e] = i
            del u
        ctx.save_for_backward(hidden, weight, labels, lse, topi)
        ctx.cfg = (chunk_rows, logit_scale, softcap, acc_dtype)
        ctx.mark_non_differentiable(argmax, topi)
        return ce, argmax, topv, topi

    @staticmethod
    def backward(ctx, g_ce, _g_argmax, g_topv, _g_topi):
        hidden, weight, labels, lse, topi = ctx.saved_tensors
        chunk_rows, logit_scale, softcap, acc_dtype = ctx.cfg
        grad_hidden = torch.empty_like(hidden)
        n = hidden.shape[0]
        for s in range(0, n, chunk_rows):
            e = min(s + chunk_rows, n)
            z = (hidden[s:e].to(weight.dtype) @ weight.t()).to(acc_dtype)
            u = _transform(z, logit_scale, softcap)
            grad_u = torch.zeros_like(u)
            if g_ce is not None:
                lab = labels[s:e]
                g = torch.where(lab >= 0, g_ce[s:e], torch.zeros_like(g_ce[s:e])).to(acc_dtype)
                # d CE / d u = softmax(u) - onehot(label)
                grad_u = (u - lse[s:e, None]).exp_().mul_(g[:, None])
                grad_u.scatter_add_(1, lab.clamp(min=0)[:, None], -g[:, None])
            if g_topv is not None and topi.shape[1] > 0:
                grad_u.scatter_add_(1, topi[s:e], g_topv[s:e].to(acc_dtype))
            # chain rule through softcap(scale * z)
            if softcap > 0.0:
                t = torch.tanh(z * (logit_scale / softcap))
                grad_u = grad_u * (1.0 - t * t)
            if logit_scale != 1.0:
                grad_u = grad_u * logit_scale
            grad_hidden[s:e] = (grad_u.to(weight.dtype) @ weight).to(hidden.dtype)
            del z, u, grad_u
        return grad_hidden, None, None, None, None, None, None


def _logits(h, weight, acc_dtype, logit_scale, softcap):
    # The matmul runs in the weight's dtype (bf16 tables on GPU); statistics in acc_dtype.
    z = (h.to(weight.dtype) @ weight.t()).to(acc_dtype)
    return _transform(z, logit_scale, softcap)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_rows: int = 2048,
    top_k: int = 0,
    logit_scale: float = 1.0,
    softcap: float = 0.0,
) -> ChunkedCEOutput:
    """Per-row CE of ``logits = softcap(logit_scale * hidden @ weight.T)`` against ``labels``.

    Args:
        hidden: ``[N, H]`` rows (any float dtype; the gradient comes back in it).
        weight: ``[V, H]`` frozen projection; must not require grad (it would silently get none).
        labels: ``[N]`` int64 targets; rows with a negative label get CE 0 and no CE gradient.
        chunk_rows: rows per chunk; peak extra memory is about ``3 * chunk_rows * V`` fp32 values.
        top_k: also return the ``top_k`` largest logits per row (values carry gradient).
        logit_scale: multiplier applied to the raw logits (``output_multiplier``).
        softcap: if > 0, ``softcap * tanh(logits / softcap)`` after the multiplier.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"chunked_cross_entropy: hidden {tuple(hidden.shape)} and weight "
            f"{tuple(weight.shape)} must be [N, H] and [V, H]"
        )
    if weight.requires_grad:
        raise ValueError("chunked_cross_entropy: the projection weight must be frozen")
    if chunk_rows <= 0:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    ce, argmax, topv, topi = _ChunkedCE.apply(
        hidden, weight, labels, int(chunk_rows), int(top_k), float(logit_scale), float(softcap)
    )
    return ChunkedCEOutput(ce=ce, argmax=argmax, topk_values=topv, topk_indices=topi)
