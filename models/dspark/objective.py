"""DSpark's loss and metrics over the backbone's blocks.

Slot convention (DeepSpec's, which SGLang serves): slot k of the block anchored at ``a`` (input
``x_a`` in slot 0, the mask token elsewhere, RoPE position ``a + k``) predicts ``x[a + k + 1]``;
its previous token, the Markov head's input, is ``x[a + k]`` (the anchor for slot 0). The
target's distribution for that token is ``softmax(lm_head(t[a + k]))``, ``t`` its final-norm
hidden states.

Eval mask ``m_k = prod_{i <= k} keep * [a + i + 1 < len] * loss_mask[a + i + 1]`` (a slot counts
only while every slot before it is a real loss token: at decoding a draft past a miss is never
verified); weight ``w_k = m_k * exp(-k / loss_gamma)``. Loss sum
``sum w (ce_w * CE + l1_w * L1 + conf_w * BCE(c, c*))`` with ``c* = 1 - L1 / 2`` (detached): the
trainer divides it by the global (accumulation and DP reduced) ``sum w``, so each term is
normalized by the same weight sum, as DeepSpec does.

Packed rows: ``len`` is the end of the anchor's document, and the labels, previous tokens and
teacher positions of slots past it (weight 0) stay inside the document
(``models/block_diffusion/documents.py``), so no slot reads another document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.block_diffusion.documents import AnchorDocuments, clamp_to_document
from models.block_diffusion.layers import DraftBlocks
from models.dspark.loss import markov_distill, start_teacher_spans
from titan_draft.protocols.features import DraftOutput


@dataclass
class SlotTargets:
    """What each slot is trained against, ``[B, N, b]``."""

    labels: torch.Tensor
    """x[a + k + 1] (clamped inside the sequence)."""
    prev: torch.Tensor
    """x[a + k], the Markov head's previous token (the anchor for slot 0)."""
    teacher_pos: torch.Tensor
    """a + k, the position whose target hidden predicts the label (clamped)."""
    mask: torch.Tensor
    """The cumulative eval mask m_k (float)."""
    weight: torch.Tensor
    """m_k * exp(-k / gamma)."""


def build_slot_targets(input_ids, loss_mask, valid_lengths, anchors, keep, block_size: int, gamma: float,
                       dtype: torch.dtype = torch.float32, docs: AnchorDocuments | None = None) -> SlotTargets:
    """The slots' targets (module docstring); ``docs``: the anchors' documents in packed rows."""
    bsz, seq = input_ids.shape
    n = anchors.shape[1]
    k = torch.arange(block_size, device=input_ids.device)
    pos = anchors[:, :, None] + k  # [B, N, b]: slot k sits at a + k

    def inside(p):
        return p.clamp(0, seq - 1) if docs is None else clamp_to_document(p, docs, seq)

    def gather(src, p):
        return src.gather(1, inside(p).reshape(bsz, -1)).view(bsz, n, block_size)

    nxt = pos + 1
    end = valid_lengths.to(pos.device)[:, None, None] if docs is None else docs.end[:, :, None]
    ok = keep[:, :, None] & (nxt < end) & gather(loss_mask.bool(), nxt)
    mask = torch.cumprod(ok.to(dtype), dim=-1)
    decay = torch.exp(-k.to(dtype) / gamma)
    return SlotTargets(labels=gather(input_ids, nxt), prev=gather(input_ids, pos), teacher_pos=inside(pos),
                       mask=mask, weight=mask * decay)


def teacher_rows(teacher_pos: torch.Tensor, seq: int) -> torch.Tensor:
    """``[B * N * b]`` int64: each slot's row in the target's hidden states flattened to
    ``[B * seq, H]`` (one row per position; each slot row reads its own, models/dspark/loss.py)."""
    bsz = teacher_pos.shape[0]
    return (teacher_pos + seq * torch.arange(bsz, device=teacher_pos.device)[:, None, None]).reshape(-1)


def early_slot_targets(draft, input_ids, loss_mask, valid_lengths, anchors, keep, docs: AnchorDocuments | None = None):
    """The slot targets (float32) and the loss chunks' teacher spans, started before the draft's
    layers run: the spans' copy to the host then waits for nothing but these few ops."""
    a = draft.args
    t = build_slot_targets(input_ids, loss_mask, valid_lengths, anchors, keep, a.block_size, a.loss_gamma,
                           docs=docs)
    spans = start_teacher_spans(teacher_rows(t.teacher_pos, input_ids.shape[1]), t.weight.reshape(-1),
                                a.ce_chunk_rows)
    return t, spans


def dspark_objective(draft, hidden: torch.Tensor, blocks: DraftBlocks, last_hidden: torch.Tensor,
                     input_ids, loss_mask, valid_lengths, early=None) -> DraftOutput:
    """Loss sum, denominator and metrics of one micro-batch (module docstring).

    ``hidden [B, N * b, H]`` are the backbone's final-norm block rows; ``draft`` supplies
    ``args``, ``markov_head``, ``confidence_head`` (or None) and ``target_lm_head``. ``early``:
    :func:`early_slot_targets` of the same anchors (None: computed here).
    """
    a = draft.args
    bsz, n = blocks.anchors.shape
    b = a.block_size
    dim = hidden.shape[-1]
    acc = torch.promote_types(hidden.dtype, torch.float32)
    t, spans = early if early is not None else (None, None)
    if t is None or t.weight.dtype != acc:  # float64 references: the targets in their dtype
        t = build_slot_targets(input_ids, loss_mask, valid_lengths, blocks.anchors, blocks.keep, b, a.loss_gamma, acc,
                               docs=blocks.docs)
    rows = hidden.reshape(-1, dim)
    feats, prev_emb = draft.markov_head.block_features(hidden.view(bsz * n, b, dim), t.prev.view(bsz * n, b))
    seq = last_hidden.shape[1]
    teacher = last_hidden.detach().reshape(bsz * seq, dim)
    w = t.weight.reshape(-1)
    m = t.mask.reshape(-1)
    labels = t.labels.reshape(-1)
    out = markov_distill(rows, feats.reshape(bsz * n * b, -1), draft.markov_head.markov_w2.weight,
                         draft.target_lm_head, teacher, labels, w, ce_weight=a.ce_loss_weight,
                         l1_weight=a.l1_loss_weight, chunk_rows=a.ce_chunk_rows,
                         teacher_index=teacher_rows(t.teacher_pos, seq), spans=spans, soft_labels=a.soft_labels)
    loss_sum = out.loss_sum
    # the probability that the target accepts a draft sampled from p_d: sum_v min(p_d, p_t)
    accept = (1.0 - 0.5 * out.l1).clamp(0.0, 1.0)
    correct = (out.argmax == labels).to(acc)
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
        "ce": ((w * out.ce).sum(), w.sum()),
        "l1": ((w * out.l1).sum(), w.sum()),
        "acc": ((m * correct).sum(), m.sum()),
    }
    m3 = t.mask
    ok3, acc3 = (m * correct).view(bsz, n, b), (m * accept).view(bsz, n, b)
    for k in range(b):
        metrics[f"acc_{k}"] = (ok3[:, :, k].sum(), m3[:, :, k].sum())
        metrics[f"accept_rate_{k}"] = (acc3[:, :, k].sum(), m3[:, :, k].sum())
    keep = blocks.keep.to(acc)
    # greedy: accepted up to the first miss; T = 1: expected accepted length of the block
    metrics["accept_len"] = ((keep * (1.0 + torch.cumprod(ok3, dim=-1).sum(dim=-1))).sum(), keep.sum())
    metrics["tau_probabilistic"] = ((keep * (1.0 + torch.cumprod(acc3, dim=-1).sum(dim=-1))).sum(), keep.sum())
    # T = 1 again, each slot drafting its argmax (accepted with p_t(argmax)), as the eval's
    # deterministic proposers draft at T > 0: the gap to tau_probabilistic is what they give up
    arg3 = (m * out.teacher_at_argmax).view(bsz, n, b)
    metrics["tau_argmax_t1"] = ((keep * (1.0 + torch.cumprod(arg3, dim=-1).sum(dim=-1))).sum(), keep.sum())

    if draft.confidence_head is not None:
        logit = draft.confidence_head(rows, prev_emb.reshape(bsz * n * b, -1)).to(acc)
        target = accept.detach()
        bce = F.binary_cross_entropy_with_logits(logit, target, reduction="none")
        bce_sum = (w * bce).sum()
        loss_sum = loss_sum + a.confidence_loss_weight * bce_sum
        c = torch.sigmoid(logit.detach())
        metrics["conf_bce"] = (bce_sum, w.sum())
        metrics["conf_abs_error"] = ((w * (c - target).abs()).sum(), w.sum())
        metrics["conf_bias"] = ((w * (c - target)).sum(), w.sum())
        # calibration of the product the proposer stops on: predicted vs true survival
        pc = torch.cumprod(c.view(bsz, n, b) * m3, dim=-1)
        pt = torch.cumprod(target.view(bsz, n, b) * m3, dim=-1)
        metrics["conf_prefix_bias"] = ((t.weight * (pc - pt)).sum(), w.sum())

    metrics = {k: (num.detach(), den.detach()) for k, (num, den) in metrics.items()}
    return DraftOutput(loss_sum=loss_sum, loss_denominator=w.sum().detach(), metrics=metrics)
