"""DSpark's distillation terms through the frozen lm_head, chunked over rows.

Slot logits are ``z = lm_head(h) + W2 f`` (backbone plus Markov bias); the target's are
``lm_head(t)`` of its own final-norm hidden ``t`` at the same position. Per row this computes the
CE against the data token (``soft_labels``: against ``softmax(z_t)``),
``L1 = sum_v |softmax(z) - softmax(z_t)|`` and the argmax, ``chunk_rows`` rows at a time:
neither distribution is alive for more rows than that, and nothing of size ``[N, V]`` is saved for
backward. Since the weighted loss ``sum w (a CE + b L1)`` is linear in the per-row terms with
weights known in forward, each chunk's gradient with respect to ``z`` is formed right there and
reduced to the gradients of ``h`` ``[N, H]``, ``f`` ``[N, r]`` and ``W2``
``[V, r]``; backward only scales them (no second lm_head pass).

d CE / dz = p - onehot(label) (``soft_labels``: p - p_t); with s = sign(p - p_t),
d L1 / dz_j = p_j (s_j - sum_v p_v s_v).

The target's logits depend only on a row's position, and overlapping blocks put several rows on
one position (512 blocks of 7 on 2048 positions: 3584 rows on <= 2048 positions a sequence).
Given ``teacher_index``, ``teacher`` holds one hidden per position and each chunk runs the frozen
lm_head over the span of positions its live rows read (the blocks are sorted by anchor, so a
chunk's rows sit on a narrow span) and gathers their rows from that, instead of one lm_head row
per slot row: at DSpark's Qwen3-8B shape 4096 instead of 7168 teacher rows a step, -3.8 TFLOP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.common.lazy_compile import LazyCompiled


@dataclass
class DistillOutput:
    loss_sum: torch.Tensor
    """Scalar ``sum_rows w (ce_weight * CE + l1_weight * L1)``, differentiable with respect to the
    hidden rows, the Markov features and ``W2``."""
    ce: torch.Tensor
    """[N] per-row CE (fp32, fp64 for fp64 inputs); not differentiable."""
    l1: torch.Tensor
    """[N] per-row ``|p_draft - p_target|_1`` in [0, 2]; not differentiable."""
    argmax: torch.Tensor
    """[N] int64 argmax of the draft logits."""
    teacher_at_argmax: torch.Tensor
    """[N] ``p_target(argmax)``: the T = 1 acceptance of a draft that proposes its argmax (a
    point mass) instead of sampling from its distribution; not differentiable."""


# Logits more than this below a row's max are raised to it before exp: past it fp32 probabilities
# turn subnormal, and subnormal operands make CPU exp and matmuls 10-60x slower (measured on a
# DSpark step: the [c, V] x [V, H] gradient matmul 19.4 s -> 0.3 s). Each raised entry moves its
# row's sums by < 1e-26.
_LOGIT_FLOOR = -60.0


def _softmax_lse(z):
    """``(softmax(z), logsumexp(z))`` of ``[c, V]`` rows from one exp, with the floor above."""
    m = z.amax(dim=-1, keepdim=True)
    e = torch.exp((z - m).clamp(min=_LOGIT_FLOOR))
    total = e.sum(dim=-1, keepdim=True)
    return e / total, m + torch.log(total)


def _chunk_stats(z_head, z_markov, z_teacher, labels, weight, ce_weight: float, l1_weight: float,
                 need_grad: bool, acc: torch.dtype, grad_dtype: torch.dtype, soft_labels: bool = False):
    """CE, L1, argmax, ``p_t(argmax)`` and (``need_grad``) ``d loss / d z`` in ``grad_dtype`` of one ``[c, V]``
    chunk, from the matmuls' outputs in the tables' dtype (``z = z_head + z_markov``, the
    target's ``z_teacher``) with statistics in ``acc`` (>= fp32). Compiled, the casts and the
    sum are part of the passes over the chunk instead of five more [c, V] fp32 tensors.
    ``soft_labels``: the CE is against the target's distribution, ``lse - sum_v p_t z``, with
    gradient ``p - p_t``, in place of the data token's ``lse - z[label]`` and ``p - onehot``."""
    z = z_head.to(acc) + z_markov.to(acc)
    zt = z_teacher.to(acc)
    p, lse = _softmax_lse(z)
    pt, _ = _softmax_lse(zt)
    gold = (pt * z).sum(dim=-1) if soft_labels else z.gather(1, labels[:, None]).squeeze(1)
    ce = lse.squeeze(-1) - gold
    diff = p - pt
    l1 = diff.abs().sum(dim=-1)
    argmax = z.argmax(dim=-1)
    pt_argmax = pt.gather(1, argmax[:, None]).squeeze(1)
    if not need_grad:
        return ce, l1, argmax, None, pt_argmax
    sign = torch.sign(diff)
    g_l1 = p * (sign - (p * sign).sum(dim=-1, keepdim=True))
    g_ce = p - pt if soft_labels else p.scatter_add(1, labels[:, None], torch.full_like(p[:, :1], -1.0))
    grad_z = weight[:, None] * (ce_weight * g_ce + l1_weight * g_l1)
    return ce, l1, argmax, grad_z.to(grad_dtype), pt_argmax


# one graph per chunk size (a run has at most two: full and last), as models/common/cross_entropy.py
_compiled_chunk_stats = LazyCompiled(_chunk_stats, fullgraph=True, dynamic=False)


def _spans_tensor(teacher_index: torch.Tensor, weight: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    n = teacher_index.shape[0]
    pad = -n % chunk_rows
    live = F.pad(weight > 0, (0, pad)).view(-1, chunk_rows)
    idx = F.pad(teacher_index, (0, pad)).view(-1, chunk_rows)
    lo = torch.where(live, idx, idx.new_full((), torch.iinfo(idx.dtype).max)).amin(dim=1)
    hi = torch.where(live, idx, idx.new_full((), -1)).amax(dim=1)
    none = ~live.any(dim=1)
    return torch.stack([lo.masked_fill(none, 0), hi.masked_fill(none, 0)], dim=1)


def teacher_spans(teacher_index: torch.Tensor, weight: torch.Tensor, chunk_rows: int) -> list[tuple[int, int]]:
    """Per chunk of ``chunk_rows`` rows, ``(lo, hi)``: the positions its live rows (weight > 0)
    read are ``lo..hi``; ``(0, 0)`` for a chunk with none. One device sync for all chunks."""
    return start_teacher_spans(teacher_index, weight, chunk_rows)()


def _pairs(spans: torch.Tensor) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in spans.tolist()]


def start_teacher_spans(teacher_index: torch.Tensor, weight: torch.Tensor,
                        chunk_rows: int) -> Callable[[], list[tuple[int, int]]]:
    """:func:`teacher_spans` started now and read later: on CUDA the spans go to pinned host
    memory behind an event, so that a caller that starts them before the draft's layers finds
    them there after, instead of stalling the host until the device has run the layers."""
    spans = _spans_tensor(teacher_index, weight, chunk_rows)
    if spans.device.type != "cuda":
        ready = _pairs(spans)
        return lambda: ready
    host = torch.empty(spans.shape, dtype=spans.dtype, pin_memory=True)
    host.copy_(spans, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def get() -> list[tuple[int, int]]:
        copied.synchronize()
        return _pairs(host)

    return get


def _teacher_logits(teacher, teacher_index, lm_head, s: int, e: int, span):
    """The target's logits ``[e - s, V]`` of rows ``s:e`` in the tables' dtype."""
    if teacher_index is None:
        return teacher[s:e].to(lm_head.dtype) @ lm_head.t()
    idx = teacher_index[s:e]
    lo, hi = span
    if hi - lo + 1 >= e - s:  # a span as wide as the chunk saves nothing: one lm_head row a row
        return teacher.index_select(0, idx).to(lm_head.dtype) @ lm_head.t()
    z = teacher[lo : hi + 1].to(lm_head.dtype) @ lm_head.t()
    # rows of weight 0 may read outside the span: any row does for them (their terms are unused)
    return z.index_select(0, (idx - lo).clamp(0, hi - lo))


class _MarkovDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, feats, w2, lm_head, teacher, teacher_index, labels, weight, ce_weight, l1_weight,
                chunk_rows, spans, soft_labels):
        n = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)
        need = any(ctx.needs_input_grad[:3])
        stats = _compiled_chunk_stats if hidden.device.type == "cuda" else _chunk_stats
        ce = torch.empty(n, dtype=acc, device=hidden.device)
        l1 = torch.empty(n, dtype=acc, device=hidden.device)
        argmax = torch.empty(n, dtype=torch.long, device=hidden.device)
        pt_argmax = torch.empty(n, dtype=acc, device=hidden.device)
        grad_h = torch.empty(n, hidden.shape[1], dtype=acc, device=hidden.device) if need else None
        grad_f = torch.empty(n, feats.shape[1], dtype=acc, device=hidden.device) if need else None
        grad_w2 = torch.zeros(w2.shape, dtype=acc, device=hidden.device) if need else None
        w = weight.to(acc)
        # the chunk's gradient comes back in the tables' dtype when both matmuls read it (bf16 on
        # GPU): it is rounded to that for them anyway
        grad_dtype = lm_head.dtype if w2.dtype == lm_head.dtype else acc
        if teacher_index is None:
            spans = None
        else:
            spans = spans() if spans is not None else teacher_spans(teacher_index, w, chunk_rows)
        for s in range(0, n, chunk_rows):
            e = min(s + chunk_rows, n)
            # matmuls in the tables' dtype (bf16 on GPU), statistics in >= fp32
            fc = feats[s:e].to(w2.dtype)
            z_head = hidden[s:e].to(lm_head.dtype) @ lm_head.t()
            span = spans[s // chunk_rows] if spans is not None else None
            z_teacher = _teacher_logits(teacher, teacher_index, lm_head, s, e, span)
            ce[s:e], l1[s:e], argmax[s:e], grad_z, pt_argmax[s:e] = stats(
                z_head, fc @ w2.t(), z_teacher, labels[s:e], w[s:e], ce_weight, l1_weight, need, acc, grad_dtype,
                soft_labels)
            del z_head, z_teacher
            if need:
                grad_h[s:e] = (grad_z.to(lm_head.dtype) @ lm_head).to(acc)
                gz = grad_z.to(w2.dtype)
                grad_f[s:e] = (gz @ w2).to(acc)
                grad_w2 += (gz.t() @ fc).to(acc)
            del grad_z
        loss_sum = (w * (ce_weight * ce + l1_weight * l1)).sum()
        ctx.save_for_backward(grad_h, grad_f, grad_w2)
        ctx.dtypes = (hidden.dtype, feats.dtype, w2.dtype)
        ctx.mark_non_differentiable(ce, l1, argmax, pt_argmax)
        return loss_sum, ce, l1, argmax, pt_argmax

    @staticmethod
    def backward(ctx, g, _g_ce, _g_l1, _g_argmax, _g_pt_argmax):
        grad_h, grad_f, grad_w2 = ctx.saved_tensors
        dh, df, dw = ctx.dtypes
        g = g.to(grad_h.dtype)
        return ((g * grad_h).to(dh), (g * grad_f).to(df), (g * grad_w2).to(dw),
                None, None, None, None, None, None, None, None, None, None)


def markov_distill(
    hidden: torch.Tensor,
    feats: torch.Tensor,
    w2: torch.Tensor,
    lm_head: torch.Tensor,
    teacher: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    *,
    ce_weight: float,
    l1_weight: float,
    chunk_rows: int = 2048,
    teacher_index: torch.Tensor | None = None,
    spans: Callable[[], list[tuple[int, int]]] | None = None,
    soft_labels: bool = False,
) -> DistillOutput:
    """The weighted CE + L1 of DSpark's slot distributions (module docstring).

    Args:
        hidden: ``[N, H]`` final-norm draft rows.
        feats: ``[N, r]`` Markov features (the bias is ``feats @ w2.T``).
        w2: ``[V, r]`` the Markov head's ``markov_w2.weight`` (trainable).
        lm_head: ``[V, H]`` the target's frozen lm_head.
        teacher: ``[N, H]`` the target's final-norm hidden at each row's position (no gradient);
            with ``teacher_index``, ``[P, H]`` one row per position.
        teacher_index: ``[N]`` int64, row ``i`` reads ``teacher[teacher_index[i]]`` (or None).
        spans: with ``teacher_index``, :func:`start_teacher_spans` of it, ``weight`` and
            ``chunk_rows``, started earlier (None: computed here, a device sync).
        labels: ``[N]`` int64 data tokens, all in ``[0, V)`` (rows without one get weight 0).
        soft_labels: the CE term against the target's distribution at the row's position instead
            of the data token (``labels`` are then not read by the loss).
        weight: ``[N]`` per-row loss weights (no gradient).
    """
    if lm_head.requires_grad or teacher.requires_grad or weight.requires_grad:
        raise ValueError("markov_distill: lm_head, teacher and weight must not require grad")
    rows = hidden.shape[0] if teacher_index is None else teacher.shape[0]
    if hidden.dim() != 2 or teacher.shape != (rows, hidden.shape[1]) or hidden.shape[1] != lm_head.shape[1]:
        raise ValueError(f"markov_distill: hidden {tuple(hidden.shape)}, teacher {tuple(teacher.shape)} and "
                         f"lm_head {tuple(lm_head.shape)} must be [N, H], [N or P, H] and [V, H]")
    if teacher_index is not None and (teacher_index.shape != hidden.shape[:1] or teacher_index.dtype != torch.long):
        raise ValueError(f"markov_distill: teacher_index must be int64 [N], got {teacher_index.dtype} "
                         f"{tuple(teacher_index.shape)}")
    if feats.shape[0] != hidden.shape[0] or w2.shape != (lm_head.shape[0], feats.shape[1]):
        raise ValueError(f"markov_distill: feats {tuple(feats.shape)} and w2 {tuple(w2.shape)} must be "
                         f"[N, r] and [V, r]")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    loss_sum, ce, l1, argmax, pt_argmax = _MarkovDistill.apply(
        hidden, feats, w2, lm_head, teacher, teacher_index, labels, weight, float(ce_weight), float(l1_weight),
        int(chunk_rows), spans, bool(soft_labels))
    return DistillOutput(loss_sum=loss_sum, ce=ce, l1=l1, argmax=argmax, teacher_at_argmax=pt_argmax)
