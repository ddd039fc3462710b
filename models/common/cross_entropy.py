"""Chunked cross-entropy through a frozen vocabulary projection.

``[N, V]`` logits over a 152k vocabulary are the largest tensor of a DFlash step (8k rows ->
~5 GB in fp32), so they are produced ``chunk_rows`` rows at a time and reduced at once to per-row
statistics and, when a gradient is needed, to the ``[N, H]`` gradient of each row's CE. Nothing
of size ``[N, V]`` is ever alive or saved for backward, and nothing is recomputed. The
projection weight is frozen (a target's lm_head) and gets no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common.lazy_compile import LazyCompiled


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
    teacher_topk: torch.Tensor | None = None
    """[N, K] the target's probability of each of those K ids (with ``teacher`` and ``top_k``;
    else None); not differentiable."""


def transform_logits(z: torch.Tensor, logit_scale: float, softcap: float) -> torch.Tensor:
    """``softcap(logit_scale * z)`` (softcap 0: none): the logits a draft's loss and its
    decoding-time proposals both use."""
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap > 0.0:
        z = softcap * torch.tanh(z / softcap)
    return z


def _chunk_stats(z, labels, logit_scale: float, softcap: float, need_grad: bool):
    """Per-row CE, argmax and (``need_grad``) ``d CE / d z`` of one ``[c, V]`` chunk of raw
    logits ``z`` (``u = softcap(scale * z)``), with statistics in at least fp32.

    On CUDA this runs compiled (:func:`_compiled_chunk_stats`): the softmax statistics, the
    argmax and the gradient come out of two passes over ``z`` instead of the ~5 full
    ``[c, V]`` fp32 passes of the eager ops, which at a 152k vocabulary cost more than the
    lm_head matmuls themselves.
    """
    acc_dtype = torch.promote_types(z.dtype, torch.float32)
    u = transform_logits(z.to(acc_dtype), logit_scale, softcap)
    valid = labels >= 0
    safe = labels.clamp(min=0)
    lse = torch.logsumexp(u, dim=-1)
    gold = u.gather(1, safe[:, None]).squeeze(1)
    ce = torch.where(valid, lse - gold, torch.zeros_like(gold))
    argmax = u.argmax(dim=-1)
    if not need_grad:
        return ce, argmax, None
    # d CE / d u = softmax(u) - onehot(label); 0 for rows without a label
    if torch.compiler.is_compiling():
        # inductor fuses this into one pass over the chunk
        vocab = torch.arange(u.shape[1], device=u.device)
        onehot = (vocab[None, :] == safe[:, None]).to(acc_dtype)
        grad_u = (torch.exp(u - lse[:, None]) - onehot) * valid[:, None].to(acc_dtype)
    else:
        # eager runs every op as its own pass over [c, V] (the CPU path): the softmax in place,
        # then only the rows without a label and the labels' entries touched, by index
        grad_u = torch.sub(u, lse[:, None]).exp_()
        grad_u[~valid] = 0.0
        rows = torch.arange(u.shape[0], device=u.device)
        grad_u.index_put_((rows, safe), valid.to(acc_dtype).neg(), accumulate=True)
    grad_u = _chain(grad_u, z.to(acc_dtype), logit_scale, softcap)
    return ce, argmax, grad_u.to(z.dtype)


def _soft_chunk_stats(z, zt, labels, logit_scale: float, softcap: float, need_grad: bool):
    """:func:`_chunk_stats` with the target's distribution ``p_t = softmax(softcap(scale * zt))``
    as the label: CE ``lse(u) - sum_v p_t u`` and ``d CE / d u = softmax(u) - p_t``, 0 for rows
    whose label is negative (their teacher row is not read). Also returns the target's
    logsumexp, from which any of its probabilities follows without another pass."""
    acc_dtype = torch.promote_types(z.dtype, torch.float32)
    u = transform_logits(z.to(acc_dtype), logit_scale, softcap)
    ut = transform_logits(zt.to(acc_dtype), logit_scale, softcap)
    lse_t = torch.logsumexp(ut, dim=-1)
    pt = torch.exp(ut - lse_t[:, None])
    valid = (labels >= 0).to(acc_dtype)
    lse = torch.logsumexp(u, dim=-1)
    ce = (lse - (pt * u).sum(dim=-1)) * valid
    argmax = u.argmax(dim=-1)
    if not need_grad:
        return ce, argmax, None, lse_t
    grad_u = (torch.exp(u - lse[:, None]) - pt) * valid[:, None]
    return ce, argmax, _chain(grad_u, z.to(acc_dtype), logit_scale, softcap).to(z.dtype), lse_t


# static shapes: a run has at most two chunk sizes (full and last), each compiled once (on first
# call, like models.common.attention's compiled flex_attention)
_compiled_chunk_stats = LazyCompiled(_chunk_stats, fullgraph=True, dynamic=False)
_compiled_soft_chunk_stats = LazyCompiled(_soft_chunk_stats, fullgraph=True, dynamic=False)


class _ChunkedCE(torch.autograd.Function):
    """Forward computes each chunk's logits once and, when ``hidden`` needs a gradient, also the
    CE's gradient with respect to ``hidden`` right there (``(softmax - onehot) @ W`` per row, kept
    as ``[N, H]``). The loss is a per-row weighted sum, so backward only scales those rows by the
    incoming per-row gradient: the ``[N, V]`` logits are never recomputed (one lm_head matmul
    fewer per step than recompute-in-backward, and one fewer pass over the logits)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_rows, top_k, topk_group, logit_scale, softcap, teacher):
        n = hidden.shape[0]
        acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
        need_grad = ctx.needs_input_grad[0]
        cuda = hidden.device.type == "cuda"
        if teacher is None:
            stats = _compiled_chunk_stats if cuda else _chunk_stats
        else:
            soft = _compiled_soft_chunk_stats if cuda else _soft_chunk_stats
        ce = torch.empty(n, dtype=acc_dtype, device=hidden.device)
        argmax = torch.empty(n, dtype=torch.long, device=hidden.device)
        topv = torch.empty(n, top_k, dtype=acc_dtype, device=hidden.device)
        topi = torch.empty(n, top_k, dtype=torch.long, device=hidden.device)
        # the target's probabilities of the top-k ids (a soft label for a selector over them)
        top_pt = torch.empty(n, top_k if teacher is not None else 0, dtype=acc_dtype, device=hidden.device)
        # d ce_row / d hidden_row, in the accumulation dtype (rounded once, after scaling)
        grad_ce = torch.empty(n, hidden.shape[1], dtype=acc_dtype, device=hidden.device) if need_grad else None
        for s in range(0, n, chunk_rows):
            e = min(s + chunk_rows, n)
            # the matmul runs in the weight's dtype (bf16 tables on GPU); statistics in >= fp32
            z = hidden[s:e].to(weight.dtype) @ weight.t()
            zt = None
            if teacher is None:
                ce_c, argmax_c, grad_z = stats(z, labels[s:e], logit_scale, softcap, need_grad)
            else:  # the target's logits of the same rows, through the same frozen head
                zt = teacher[s:e].to(weight.dtype) @ weight.t()
                ce_c, argmax_c, grad_z, lse_t = soft(z, zt, labels[s:e], logit_scale, softcap, need_grad)
            ce[s:e] = ce_c
            argmax[s:e] = argmax_c
            if top_k > 0:
                # softcap(scale * z) is increasing in z: the top-k of z are those of the logits
                v, i = topk_by_group_max(z, top_k, topk_group)
                topv[s:e] = transform_logits(v.to(acc_dtype), logit_scale, softcap)
                topi[s:e] = i
                if zt is not None:
                    ut = transform_logits(zt.gather(1, i).to(acc_dtype), logit_scale, softcap)
                    top_pt[s:e] = torch.exp(ut - lse_t[:, None])
            del zt
            if need_grad:
                grad_ce[s:e] = (grad_z @ weight).to(acc_dtype)  # grad_z has z's (the weight's) dtype
            del z, grad_z
        ctx.save_for_backward(grad_ce, weight, topi, topv)
        ctx.cfg = (chunk_rows, logit_scale, softcap, hidden.dtype)
        ctx.mark_non_differentiable(argmax, topi, top_pt)
        return ce, argmax, topv, topi, top_pt

    @staticmethod
    def backward(ctx, g_ce, _g_argmax, g_topv, _g_topi, _g_top_pt):
        grad_ce, weight, topi, topv = ctx.saved_tensors
        chunk_rows, logit_scale, softcap, hidden_dtype = ctx.cfg
        acc_dtype = grad_ce.dtype
        n = grad_ce.shape[0]
        grad_hidden = torch.zeros_like(grad_ce) if g_ce is None else grad_ce * g_ce.to(acc_dtype)[:, None]
        if g_topv is not None and topi.shape[1] > 0:
            # the top-k logits' gradient reaches hidden through their K rows of the weight only
            for s in range(0, n, chunk_rows):
                e = min(s + chunk_rows, n)
                g = g_topv[s:e].to(acc_dtype)
                if softcap > 0.0:  # u = softcap * tanh(scale * z / softcap): du/dz from u itself
                    t = topv[s:e] / softcap
                    g = g * (1.0 - t * t)
                if logit_scale != 1.0:
                    g = g * logit_scale
                rows = weight[topi[s:e]]  # [c, K, H]
                grad_hidden[s:e] += torch.einsum("ck,ckh->ch", g.to(weight.dtype), rows).to(acc_dtype)
        return grad_hidden.to(hidden_dtype), None, None, None, None, None, None, None, None


def topk_by_group_max(z: torch.Tensor, k: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``z.topk(k, dim=-1)`` of a ``[rows, V]`` matrix in two cheap passes instead of one
    vocabulary-wide selection: the max of every ``group`` consecutive columns, the ``k`` groups
    with the largest maxima, then the top-k of those ``k * group`` columns.

    Exact values: with ``t`` the k-th largest value, fewer than ``k`` elements exceed ``t``, so
    every group holding one is among the k best groups, and each other chosen group has max
    ``t``. Among equal values the chosen index may differ from torch.topk's (whose tie order is
    unspecified too). One plain ``topk`` when ``group`` is 0, ``V`` is not a multiple of ``group``
    or there are fewer than ``k`` groups.
    """
    rows, width = z.shape
    if group <= 0 or width % group or width // group < k:
        return z.topk(k, dim=-1)
    group_max = z.view(rows, width // group, group).amax(dim=-1)  # [rows, G]
    groups = group_max.topk(k, dim=-1).indices  # [rows, k]
    cols = (groups[:, :, None] * group + torch.arange(group, device=z.device)).flatten(1)  # [rows, k*group]
    top, pos = z.gather(1, cols).topk(k, dim=-1)
    return top, cols.gather(1, pos)


def _chain(grad_u: torch.Tensor, z: torch.Tensor, logit_scale: float, softcap: float) -> torch.Tensor:
    """Gradient with respect to the raw logits ``z`` from the one with respect to
    ``u = softcap(scale * z)``."""
    if softcap > 0.0:
        t = torch.tanh(z * (logit_scale / softcap))
        grad_u = grad_u * (1.0 - t * t)
    if logit_scale != 1.0:
        grad_u = grad_u * logit_scale
    return grad_u


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_rows: int = 2048,
    top_k: int = 0,
    topk_group: int = 0,
    logit_scale: float = 1.0,
    softcap: float = 0.0,
    teacher: torch.Tensor | None = None,
) -> ChunkedCEOutput:
    """Per-row CE of ``logits = softcap(logit_scale * hidden @ weight.T)`` against ``labels``
    (with ``teacher``, against the target's distribution at each row).

    Args:
        hidden: ``[N, H]`` rows (any float dtype; the gradient comes back in it).
        weight: ``[V, H]`` frozen projection; must not require grad (it would silently get none).
        labels: ``[N]`` int64 targets; rows with a negative label get CE 0 and no CE gradient.
        chunk_rows: rows per chunk; peak extra memory is about ``3 * chunk_rows * V`` fp32 values.
        top_k: also return the ``top_k`` largest logits per row (values carry gradient).
        topk_group: 0 takes them with ``torch.topk``; > 0 with :func:`topk_by_group_max` over
            groups of that many columns (same values).
        logit_scale: multiplier applied to the raw logits (``output_multiplier``).
        softcap: if > 0, ``softcap * tanh(logits / softcap)`` after the multiplier.
        teacher: ``[N, H]`` the target's final-norm hidden state that predicts each row's label
            (no gradient): the CE is then against ``softmax(softcap(logit_scale * teacher @
            weight.T))``, the target's own distribution, instead of the label; a row with a
            negative label still gets CE 0. The labels keep the argmax and top-k meaning.
            With ``top_k``, ``teacher_topk`` holds that distribution at the top-k ids.
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
    if topk_group < 0:
        raise ValueError(f"topk_group must be >= 0, got {topk_group}")
    if logit_scale <= 0:
        # the top-k are taken on the raw logits, which needs an increasing transform
        raise ValueError(f"logit_scale must be positive, got {logit_scale}")
    if teacher is not None and (teacher.shape != hidden.shape or teacher.requires_grad):
        raise ValueError(f"chunked_cross_entropy: teacher {tuple(teacher.shape)} must be hidden's shape "
                         f"{tuple(hidden.shape)} and need no gradient")
    ce, argmax, topv, topi, top_pt = _ChunkedCE.apply(
        hidden, weight, labels, int(chunk_rows), int(top_k), int(topk_group), float(logit_scale), float(softcap),
        teacher,
    )
    return ChunkedCEOutput(ce=ce, argmax=argmax, topk_values=topv, topk_indices=topi,
                           teacher_topk=top_pt if teacher is not None and top_k > 0 else None)
