"""The contract between targets/data and drafts.

Online mode (a frozen target runs inside the trainer) and offline mode (features read from disk)
both produce a ``TargetFeatures``; every draft consumes exactly this and returns a ``DraftOutput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import register_dataclass


@dataclass
class TargetFeatures:
    """One micro-batch of target-side tensors, all on the training device.

    Layer outputs follow the SGLang convention: capture layer id ``i`` is the (unnormalized) output
    of decoder layer ``i`` (HF ``hidden_states[i + 1]``).
    """

    input_ids: torch.Tensor
    """[B, S] int64 token ids (padding uses the tokenizer's pad id)."""
    loss_mask: torch.Tensor
    """[B, S] bool, True on tokens the draft is trained to predict (assistant tokens)."""
    valid_lengths: torch.Tensor
    """[B] int64, number of real (non-padding) tokens per row."""
    aux_hidden: torch.Tensor
    """[B, S, K*H] capture-layer outputs concatenated in the order the draft asked for."""
    last_hidden: torch.Tensor | None = None
    """[B, S, H] final-norm last hidden state (only for drafts that ask for it)."""
    document_ids: torch.Tensor | None = None
    """[B, S] int32 when rows are packed (``data.packing``): the index 0, 1, ... of the document
    each position belongs to, in row order; the padding after the row's last document carries one
    id more than that document. None: every row is one document, ``valid_lengths`` long."""

    def document_spans(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(starts, ends)``, both ``[B, S]`` int64: for each position, the first position of its
        document and one past the document's last real token. A position ``p`` is a real token iff
        ``p < ends[p]``; padding is a document with no real token (``ends == starts``). Attention,
        labels and teacher positions of position ``p`` stay inside ``[starts[p], ends[p])``."""
        return document_spans(self.document_ids, self.valid_lengths, self.input_ids.shape[1])

    def position_ids(self) -> torch.Tensor:
        """``[B, S]`` int64 RoPE positions restarting at 0 at each document (``[1, S]`` ``arange(S)`` unpacked)."""
        return position_ids(self.document_ids, self.input_ids.shape[1], self.input_ids.device)


def document_spans(document_ids: torch.Tensor | None, valid_lengths: torch.Tensor,
                   seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """See :meth:`TargetFeatures.document_spans` (also for callers that hold the tensors only)."""
    lengths = valid_lengths.to(torch.long)
    if document_ids is None:
        starts = torch.zeros(lengths.shape[0], seq_len, dtype=torch.long, device=lengths.device)
        return starts, lengths[:, None].expand(-1, seq_len).clone()
    ids = document_ids
    pos = torch.arange(seq_len, device=ids.device).expand_as(ids)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = torch.where(first, pos, torch.zeros_like(pos)).cummax(dim=1).values
    last = torch.ones_like(ids, dtype=torch.bool)
    last[:, :-1] = ids[:, 1:] != ids[:, :-1]
    # one past each document's last position, carried leftwards over the document
    after = torch.where(last, pos + 1, torch.full_like(pos, seq_len))
    ends = after.flip(1).cummin(dim=1).values.flip(1)
    # the padding tail ends where it starts: the row's real tokens stop at its valid length
    ends = torch.minimum(ends, lengths.to(ids.device)[:, None]).maximum(starts)
    return starts, ends


def position_ids(document_ids: torch.Tensor | None, seq_len: int, device) -> torch.Tensor:
    """See :meth:`TargetFeatures.position_ids`."""
    pos = torch.arange(seq_len, device=device)
    if document_ids is None:
        return pos[None, :]
    first = torch.ones_like(document_ids, dtype=torch.bool)
    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    pos = pos.expand_as(document_ids)
    return pos - torch.where(first, pos, torch.zeros_like(pos)).cummax(dim=1).values


@dataclass
class DraftOutput:
    """What a draft objective returns for one micro-batch.

    The trainer backpropagates ``loss_sum`` (a weighted *sum*, not a mean), all-reduces
    ``loss_denominator`` over micro-batches and DP ranks, and divides gradients by that global
    denominator, so accumulation and data parallelism give an exact token-weighted mean.
    """

    loss_sum: torch.Tensor
    """Scalar: the sum of weighted per-token losses (differentiable)."""
    loss_denominator: torch.Tensor
    """Scalar: the sum of weights that ``loss_sum`` is normalized by (not differentiable)."""
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """name -> (numerator, denominator) scalar sums; the trainer sums both over micro-batches and
    ranks and logs numerator / denominator."""


# FSDP2 hooks a unit's backward onto the tensors of its forward's output, found with pytree. Up to
# torch 2.11 that is ``tree_flatten``, which does not look inside an unregistered dataclass: a draft
# whose root is its only FSDP unit (EAGLE-3) then never queued FSDP's post-backward, and not one
# gradient reached its sharded parameters (seen on the H200, 2026-12-02).
register_dataclass(DraftOutput)
