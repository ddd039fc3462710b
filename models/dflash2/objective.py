"""DFlash / DFlash2 training tensors: anchors, blocks, attention mask, loss and metrics.

Shapes: B sequences of length S, N anchors per sequence, blocks of b slots, R = N * b rows.
Block n of sequence i covers positions ``a_n .. a_n + b - 1``; slot 0 holds the anchor token
(the last committed token) and is not supervised, slot k >= 1 predicts ``x[a_n + k]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.common import chunked_cross_entropy
from titan_draft.protocols.features import DraftOutput


def sample_anchors(
    loss_mask: torch.Tensor,
    valid_lengths: torch.Tensor,
    num_anchors: int,
    static: bool,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample block anchors uniformly without replacement -> ``(anchors [B, N], keep [B, N])``.

    Candidates are ``t <= S - 2`` with ``loss_mask[t] & loss_mask[t + 1]`` and
    ``t + 1 < valid_length``. Each candidate gets a random key; the N largest keys win and the
    winners are sorted by position. N is ``num_anchors`` when ``static`` (one shape per run),
    else ``min(num_anchors, largest candidate count in the batch)`` (a host sync), at least 1 so
    every rank runs the same graph even on a batch with nothing to learn. Unused slots have
    ``keep=False``, anchor 0 and come last.
    """
    bsz, seq = loss_mask.shape
    device = loss_mask.device
    lm = loss_mask.bool()
    t = torch.arange(max(seq - 1, 0), device=device)
    cand = lm[:, :-1] & lm[:, 1:] & (t[None, :] + 1 < valid_lengths.to(device)[:, None])
    if static:
        n = num_anchors
    else:
        n = max(1, min(num_anchors, int(cand.sum(dim=1).max().item()) if seq > 1 else 0))
    width = max(seq - 1, n)
    if width > cand.shape[1]:
        cand = torch.cat([cand, cand.new_zeros(bsz, width - cand.shape[1])], dim=1)
    gen_device = generator.device if generator is not None else device
    keys = torch.rand(bsz, width, generator=generator, device=gen_device).to(device)
    keys = torch.where(cand, keys, torch.full_like(keys, -1.0))
    top, idx = keys.topk(n, dim=1)
    # sort the winners by position, pushing unused slots to the end
    order_key = torch.where(top >= 0, idx, idx + width)
    order_key, _ = order_key.sort(dim=1)
    keep = order_key < width
    anchors = torch.where(keep, order_key, torch.zeros_like(order_key))
    return anchors, keep


@dataclass
class DraftBlocks:
    """Per-block tensors built from the anchors."""

    anchors: torch.Tensor
    """[B, N] int64 anchor positions (0 for unused slots)."""
    keep: torch.Tensor
    """[B, N] bool, False for padded anchor slots."""
    block_ids: torch.Tensor
    """[B, R] draft input ids: the anchor token in slot 0, mask_token_id elsewhere."""
    positions: torch.Tensor
    """[B, R] RoPE positions a_n + k."""
    labels: torch.Tensor
    """[B, N, b] gold token x[a_n + k] (clamped inside the sequence)."""
    prev: torch.Tensor
    """[B, N, b] gold predecessor x[a_n + k - 1] (slot 1's is the anchor token)."""
    mask: torch.Tensor
    """[B, N, b] float: keep * [a_n + k < valid_len] * loss_mask[a_n + k], 0 for slot 0."""
    weight: torch.Tensor
    """[B, N, b] float: mask * exp(-(k - 1) / gamma)."""


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    valid_lengths: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    weight_dtype: torch.dtype = torch.float32,
) -> DraftBlocks:
    bsz, seq = input_ids.shape
    n = anchors.shape[1]
    k = torch.arange(block_size, device=input_ids.device)
    pos = anchors[:, :, None] + k  # [B, N, b]

    def gather(src: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return src.gather(1, p.clamp(0, seq - 1).reshape(bsz, -1)).view(bsz, n, block_size)

    labels = gather(input_ids, pos)
    prev = gather(input_ids, pos - 1)
    in_range = pos < valid_lengths.to(pos.device)[:, None, None]
    supervised = keep[:, :, None] & in_range & gather(loss_mask.bool(), pos) & (k >= 1)
    mask = supervised.to(weight_dtype)
    decay = torch.exp(-(k.to(weight_dtype) - 1) / gamma)
    block_ids = torch.where(k == 0, labels, torch.full_like(labels, mask_token_id))
    return DraftBlocks(
        anchors=anchors,
        keep=keep,
        block_ids=block_ids.view(bsz, -1),
        positions=pos.view(bsz, -1),
        labels=labels,
        prev=prev,
        mask=mask,
        weight=mask * decay,
    )


def make_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int):
    """flex ``mask_mod`` over ``Q_LEN = N * b`` block rows and ``KV_LEN = S + N * b`` keys.

    Query ``q`` (block ``n = q // b``) sees context key ``kv < S`` iff ``kv < a_n`` (strictly:
    at inference the anchor's own target feature does not exist yet) and the block is kept,
    and block key ``kv >= S`` iff it is in its own block (bidirectional). Padded blocks thus
    see only themselves: no empty rows, and their loss weight is 0.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        see_context = (kv_idx < context_len) & (kv_idx < anchors[b, blk]) & keep[b, blk]
        own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == blk)
        return see_context | own_block

    return mask_mod


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
) -> DraftOutput:
    """Weighted CE of slots 1..b-1 through the frozen lm_head, plus the selector CE.

    ``loss_sum = sum w * CE + alpha * sum w * [gold in top-K] * selector_CE``; the denominator is
    ``sum w``. Slot 0 rows are dropped before the lm_head (a static slice: shapes stay fixed).
    Selector rows whose gold token is outside the unary top-K get no selector loss (SpecForge's
    current choice; injecting the gold token would train scores for candidates the server never
    sees). Their miss is visible in ``topk_recall`` and counts as wrong in ``selector_acc``.
    """
    bsz, n, b = blocks.labels.shape
    dim = hidden.shape[-1]
    rows = hidden.view(bsz, n, b, dim)[:, :, 1:].reshape(-1, dim)
    labels = blocks.labels[:, :, 1:].reshape(-1)
    out = chunked_cross_entropy(
        rows,
        lm_head_weight,
        labels,
        chunk_rows=chunk_rows,
        top_k=selector_top_k if selector is not None else 0,
        topk_group=selector_topk_group,
        logit_scale=logit_scale,
        softcap=softcap,
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
        target = hit.to(torch.long).argmax(dim=-1)  # 0 when missing; those rows get weight 0
        sel_ce = torch.logsumexp(scores, dim=-1) - scores.gather(1, target[:, None]).squeeze(1)
        sel_w = w * in_topk
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
