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
