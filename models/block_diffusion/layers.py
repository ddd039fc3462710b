"""The block-diffusion backbone's tensors and attention, shared by the DFlash family and DSpark.

A draft block of ``b`` slots is anchored at a committed token ``x_a``: slot 0 holds the anchor,
the other slots the mask token, at positions ``a .. a + b - 1``. Every slot sees the target's
features of the context strictly before the anchor (at inference the anchor's own features do
not exist yet) and, bidirectionally, the slots of its own block. Shapes: B sequences of length
S, N anchors per sequence, R = N * b block rows.

What a slot predicts and how slots are weighted is the draft's own objective (DFlash: slot
k >= 1 predicts ``x[a + k]``, slot 0 is not supervised).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.block_diffusion.documents import AnchorDocuments, clamp_to_document
from models.common.attention import QKNormProjections, attention
from models.common.mlp import SwiGLU
from models.common.norm import RMSNorm
from models.common.rope import apply_rope

Rope = tuple[torch.Tensor, torch.Tensor]

__all__ = ["BlockAttention", "BlockDecoderLayer", "DraftBlocks", "Rope", "anchor_fill", "build_blocks",
           "make_mask_mod", "sample_anchors"]


def sample_anchors(
    loss_mask: torch.Tensor,
    valid_lengths: torch.Tensor,
    num_anchors: int,
    static: bool,
    generator: torch.Generator | None = None,
    ends: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample block anchors uniformly without replacement -> ``(anchors [B, N], keep [B, N])``.

    Candidates are ``t <= S - 2`` with ``loss_mask[t] & loss_mask[t + 1]`` and
    ``t + 1 < valid_length``, or, for packed rows (``ends [B, S]`` from
    ``TargetFeatures.document_spans``), ``t + 1 < ends[t]``: the anchor's next token is in its
    document. Uniform over a row's candidates, the anchors spread over its documents in
    proportion to their candidates (a document without loss tokens gets none). Each candidate gets a random key; the N largest keys win and the
    winners are sorted by position. N is ``num_anchors`` when ``static`` (one shape per run),
    else ``min(num_anchors, largest candidate count in the batch)`` (a host sync), at least 1 so
    every rank runs the same graph even on a batch with nothing to learn. Unused slots have
    ``keep=False``, anchor 0 and come last.
    """
    bsz, seq = loss_mask.shape
    device = loss_mask.device
    lm = loss_mask.bool()
    t = torch.arange(max(seq - 1, 0), device=device)
    limit = valid_lengths.to(device)[:, None] if ends is None else ends[:, :-1].to(device)
    cand = lm[:, :-1] & lm[:, 1:] & (t[None, :] + 1 < limit)
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


def anchor_fill(keep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``anchor_fill`` metric, ``(kept anchors, anchor slots)``: the share of ``num_anchors``
    a step trains. Below 1, rows have fewer anchor candidates than slots (short padded rows):
    packing, or fewer anchors, fills them; near 1, more anchors would add signal."""
    kept = keep.to(dtype).sum()
    return kept, torch.full_like(kept, keep.numel())


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
    docs: AnchorDocuments | None = None
    """The anchors' documents in packed rows (None: one document per row)."""


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
    docs: AnchorDocuments | None = None,
) -> DraftBlocks:
    """The blocks of ``anchors``; with ``docs`` (packed rows) a block's labels and ``in_range``
    stop at its anchor's document end and its RoPE positions count from the document start."""
    bsz, seq = input_ids.shape
    n = anchors.shape[1]
    k = torch.arange(block_size, device=input_ids.device)
    pos = anchors[:, :, None] + k  # [B, N, b]

    def gather(src: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        p = p.clamp(0, seq - 1) if docs is None else clamp_to_document(p, docs, seq)
        return src.gather(1, p.reshape(bsz, -1)).view(bsz, n, block_size)

    labels = gather(input_ids, pos)
    prev = gather(input_ids, pos - 1)
    end = valid_lengths.to(pos.device)[:, None, None] if docs is None else docs.end[:, :, None]
    in_range = pos < end
    supervised = keep[:, :, None] & in_range & gather(loss_mask.bool(), pos) & (k >= 1)
    mask = supervised.to(weight_dtype)
    decay = torch.exp(-(k.to(weight_dtype) - 1) / gamma)
    block_ids = torch.where(k == 0, labels, torch.full_like(labels, mask_token_id))
    return DraftBlocks(
        anchors=anchors,
        keep=keep,
        block_ids=block_ids.view(bsz, -1),
        positions=pos.view(bsz, -1) if docs is None else (docs.position(anchors)[:, :, None] + k).view(bsz, -1),
        labels=labels,
        prev=prev,
        mask=mask,
        weight=mask * decay,
        docs=docs,
    )


def make_mask_mod(anchors: torch.Tensor, keep: torch.Tensor, context_len: int, block_size: int,
                  doc_starts: torch.Tensor | None = None):
    """flex ``mask_mod`` over ``Q_LEN = N * b`` block rows and ``KV_LEN = S + N * b`` keys.

    Query ``q`` (block ``n = q // b``) sees context key ``kv < S`` iff ``kv < a_n`` (strictly:
    at inference the anchor's own target feature does not exist yet) and the block is kept,
    and block key ``kv >= S`` iff it is in its own block (bidirectional). Padded blocks thus
    see only themselves: no empty rows, and their loss weight is 0. In packed rows
    (``doc_starts [B, N]``, each anchor's document start) the context also starts there:
    ``doc_starts[n] <= kv < a_n``.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // block_size
        see_context = (kv_idx < context_len) & (kv_idx < anchors[b, blk]) & keep[b, blk]
        if doc_starts is not None:
            see_context = see_context & (kv_idx >= doc_starts[b, blk])
        own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == blk)
        return see_context | own_block

    return mask_mod


class BlockAttention(QKNormProjections):
    """KV injection: block queries attend to [context ; block] keys through the same k/v
    projections (the context rows are the projected target features, the block rows the draft's
    own stream)."""

    def keys_values(self, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v [B, kv_heads, L, D]`` of rows ``h [B, L, H]`` (k normed and rotated): the
        context part is all a decoding draft caches, since it does not depend on the block."""
        bsz, rows, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(bsz, rows, self.n_kv_heads, self.head_dim))
        v = self.v_proj(h).view(bsz, rows, self.n_kv_heads, self.head_dim)
        return apply_rope(k.transpose(1, 2), *rope), v.transpose(1, 2)

    def forward(self, x, ctx, rope_q: Rope, rope_k: Rope, attn_mask) -> torch.Tensor:
        """``ctx`` is the ``[B, S, H]`` context (``rope_k`` then covers context and block
        positions) or its cached ``(k, v)`` from :meth:`keys_values` (``rope_k`` the block's)."""
        bsz, rows, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, rows, self.n_heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), *rope_q)
        if isinstance(ctx, torch.Tensor):
            # Two projections instead of one on cat([ctx, x]): the concatenated outputs are 4x
            # narrower than the inputs (GQA), and each call keeps a static row count for float8.
            k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=1)
            v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=1)
            k = self.k_norm(k.view(bsz, -1, self.n_kv_heads, self.head_dim))
            k = apply_rope(k.transpose(1, 2), *rope_k)
            v = v.view(bsz, -1, self.n_kv_heads, self.head_dim).transpose(1, 2)
        else:
            kx, vx = self.keys_values(x, rope_k)
            k, v = torch.cat([ctx[0], kx], dim=2), torch.cat([ctx[1], vx], dim=2)
        o = attention(q, k, v, attn_mask)
        return self.o_proj(o.transpose(1, 2).reshape(bsz, rows, -1))


class BlockDecoderLayer(nn.Module):
    """Pre-norm Qwen3-style layer over the block stream, attending through :class:`BlockAttention`."""

    def __init__(self, args):
        super().__init__()
        h = args.hidden_size
        self.input_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.self_attn = BlockAttention(args)
        self.post_attention_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.mlp = SwiGLU(h, args.intermediate_size)

    def forward(self, x: torch.Tensor, ctx, rope_q: Rope, rope_k: Rope, attn_mask) -> torch.Tensor:
        """``x [B, R, H]`` block stream, ``ctx [B, S, H]`` projected target context (or its
        cached keys and values, see :meth:`BlockAttention.forward`)."""
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))
