"""DFlash / DFlash2 loss and metrics over the backbone's blocks (models/block_diffusion/layers.py).

Slot 0 of a block holds the anchor token (the last committed token) and is not supervised; slot
k >= 1 predicts ``x[a_n + k]`` with weight ``exp(-(k - 1) / gamma)``.
"""

from __future__ import annotations

import torch

from models.common import chunked_cross_entropy
from models.block_diffusion.layers import DraftBlocks
from titan_draft.protocols.features import DraftOutput


def dflash_objective(
    hidden: torch.Tensor,
    blocks: DraftBlocks,
    lm_head_weight: torch.Tensor,
    *,
    chunk_rows: int,
    logit_scale: float = 1.0,
    softcap: float = 0.0,
    selector=None,
    selector_top_k: int = 0,
    selector_topk_group: int = 0,
    selector_alpha: float = 0.0,
    detach_unary: bool = False,
    teacher_hidden: torch.Tensor | None = None,
) -> DraftOutput:
    """Weighted CE of slots 1..b-1 through the frozen lm_head, plus the selector CE.

    ``loss_sum = sum w * CE + alpha * sum w * [gold in top-K] * selector_CE``; the denominator is
    ``sum w``. Slot 0 rows are dropped before the lm_head (a static slice: shapes stay fixed).
    Selector rows whose gold token is outside the unary top-K get no selector loss (SpecForge's
    current choice; injecting the gold token would train scores for candidates the server never
    sees). Their miss is visible in ``topk_recall`` and counts as wrong in ``selector_acc``.
    ``teacher_hidden [B, S, H]`` (the target's final-norm hidden states): each slot's CE is against
    the target's distribution where it predicted the slot's token (position ``a_n + k - 1``)
    instead of the token itself, and the selector's CE is against that distribution over the
    slot's candidates (renormalized), weighted by its mass on them instead of by the gold token
    being one. Accuracies and recall still read the data's token.
    """
    bsz, n, b = blocks.labels.shape
    dim = hidden.shape[-1]
    rows = hidden.view(bsz, n, b, dim)[:, :, 1:].reshape(-1, dim)
    labels = blocks.labels[:, :, 1:].reshape(-1)
    teacher = None
    if teacher_hidden is not None:
        last = teacher_hidden.shape[1] - 1
        k = torch.arange(1, b, device=blocks.anchors.device)
        # rows without a label (weight 0) read a clamped position; their term is never used
        pos = (blocks.anchors[:, :, None] + k - 1).clamp(max=last).reshape(bsz, -1, 1)
        teacher = teacher_hidden.detach().gather(1, pos.expand(-1, -1, dim)).reshape(-1, dim)
    out = chunked_cross_entropy(
        rows,
        lm_head_weight,
        labels,
        chunk_rows=chunk_rows,
        top_k=selector_top_k if selector is not None else 0,
        topk_group=selector_topk_group,
        logit_scale=logit_scale,
        softcap=softcap,
        teacher=teacher,
    )
    acc_dtype = out.ce.dtype
    w = blocks.weight[:, :, 1:].reshape(-1).to(acc_dtype)
    m = blocks.mask[:, :, 1:].reshape(-1).to(acc_dtype)
    ce_sum = (w * out.ce).sum()
    correct = (out.argmax == labels).to(acc_dtype)
    loss_sum = ce_sum

    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
        "ce": (ce_sum.detach(), w.sum()),
        "acc": ((m * correct).sum(), m.sum()),
    }
    m3, c3 = m.view(bsz, n, b - 1), correct.view(bsz, n, b - 1)
    for k in range(1, b):
        metrics[f"acc_{k}"] = ((m3[:, :, k - 1] * c3[:, :, k - 1]).sum(), m3[:, :, k - 1].sum())
    keep = blocks.keep.to(acc_dtype)
    metrics["accept_len"] = (_accept_len_sum(m3 * c3, keep), keep.sum())

    if selector is not None:
        unary = out.topk_values.detach() if detach_unary else out.topk_values
        cand = out.topk_indices
        prev = blocks.prev[:, :, 1:].reshape(-1)
        scores = selector(rows, prev, cand, unary)
        hit = cand == labels[:, None]
        in_topk = hit.any(dim=-1).to(acc_dtype)
        lse = torch.logsumexp(scores, dim=-1)
        if out.teacher_topk is None:
            target = hit.to(torch.long).argmax(dim=-1)  # 0 when missing; those rows get weight 0
            sel_ce = lse - scores.gather(1, target[:, None]).squeeze(1)
            sel_w = w * in_topk
        else:
            # soft labels: the target's distribution over the candidates, renormalized, weighted
            # by its mass there (the expectation of the hard rule's in-top-K weight)
            inside = out.teacher_topk.sum(dim=-1)
            pc = out.teacher_topk / inside.clamp_min(torch.finfo(acc_dtype).tiny)[:, None]
            sel_ce = lse - (pc * scores).sum(dim=-1)
            sel_w = w * inside
        sel_sum = (sel_w * sel_ce).sum()
        loss_sum = loss_sum + selector_alpha * sel_sum
        sel_correct = hit.gather(1, scores.argmax(dim=-1, keepdim=True)).squeeze(1).to(acc_dtype)
        metrics["selector_ce"] = (sel_sum.detach(), sel_w.sum())
        metrics["selector_acc"] = ((m * sel_correct).sum(), m.sum())
        metrics["topk_recall"] = ((m * in_topk).sum(), m.sum())
        metrics["selector_accept_len"] = (
            _accept_len_sum(m3 * sel_correct.view(bsz, n, b - 1), keep),
            keep.sum(),
        )

    metrics = {k: (num.detach(), den.detach()) for k, (num, den) in metrics.items()}
    return DraftOutput(loss_sum=loss_sum, loss_denominator=w.sum().detach(), metrics=metrics)


def _accept_len_sum(ok: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Sum over kept blocks of ``1 + sum_k prod_{i <= k} ok_i`` (greedy chain acceptance with
    teacher-forced prefixes: the draft is accepted up to its first miss)."""
    return (keep * (1.0 + torch.cumprod(ok, dim=-1).sum(dim=-1))).sum()
