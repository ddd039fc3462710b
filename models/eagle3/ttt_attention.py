"""EAGLE-3's training-time-test attention in diagonal form (``model.args.ttt_attention = "diagonal"``).

Step i's queries see step 0's keys causally (inside the sequence, or the document when packed)
and the keys of steps 1..i at their own position only (``objective.ttt_mask_mod``). The concat
form attends to all ``(i + 1) * S`` keys under that mask: each step has another key length, so the
compiled layer is traced once per step (7 forward and 7 backward graphs at ``ttt_steps = 7``), and
flex computes whole diagonal tiles of the later steps' keys for one key per query.

The diagonal form computes the same softmax in two parts and merges them by their log-sum-exp:
step 0's keys under the step-0 mask (the same ``S x S`` mask at every step), and per-position
dot products with the later steps' keys, held in a fixed number of slots (the unused ones masked)
so that every step after the first has the same shapes and one traced graph serves them all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from models.common import attention_with_lse

KV = tuple[torch.Tensor, torch.Tensor]


class DiagonalPast(NamedTuple):
    """What step i >= 1 attends to besides its own keys: step 0's keys and values ``k0, v0
    [B, Hkv, S, D]`` (causally, under the step-0 mask), and those of steps 1..i-1 in slots ``k, v
    [B, Hkv, S, slots, D]`` (each at its own position), ``used [slots]`` marking the filled ones."""

    k0: torch.Tensor
    v0: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    used: torch.Tensor


def diagonal_slots(ttt_steps: int) -> int:
    """Slots for the keys of steps 1..i-1: at most ``ttt_steps - 2`` are filled (at least one
    slot, so that the shapes never have a zero dimension)."""
    return max(ttt_steps - 2, 1)


def build_diagonal_past(past: list[KV], slots: int) -> DiagonalPast:
    """``past``: the keys and values of steps 0..i-1, as the concat form takes them."""
    (k0, v0), later = past[0], past[1:]
    if len(later) > slots:
        raise ValueError(f"{len(later)} later steps do not fit {slots} slots")
    # the empty slots require grad when the keys do: the slots' tensors then look alike at every
    # step (at step 1 all of them are empty), and one traced graph serves all steps
    pad = [torch.zeros_like(k0).requires_grad_(k0.requires_grad)] * (slots - len(later))
    used = torch.arange(slots, device=k0.device) < len(later)
    return DiagonalPast(k0, v0, torch.stack([k for k, _ in later] + pad, dim=3),
                        torch.stack([v for _, v in later] + pad, dim=3), used)


def diagonal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: DiagonalPast, mask0) -> torch.Tensor:
    """``q [B, H, S, D]`` attending to ``past`` and to this step's ``k, v [B, Hkv, S, D]`` at its own
    position -> ``[B, H, S, D]``; ``mask0``: step 0's keys' mask (a BlockMask or a dense
    ``[B, 1, S, S]`` mask), scale ``1/sqrt(D)`` as :func:`models.common.attention`."""
    o0, lse0 = attention_with_lse(q, past.k0, past.v0, mask0)
    b, h, s, d = q.shape
    g, acc = h // k.shape[1], lse0.dtype
    # query head j reads key head j // g (flex's enable_gqa, repeat_interleave): group them
    qg = q.reshape(b, h // g, g, s, d).to(acc)
    own = (qg * k[:, :, None].to(acc)).sum(-1, keepdim=True) * d**-0.5
    later = torch.einsum("bkgsd,bksjd->bkgsj", qg, past.k.to(acc)) * d**-0.5
    later = later.masked_fill(~past.used, torch.finfo(acc).min)
    w = torch.softmax(torch.cat([lse0.view(b, h // g, g, s, 1), own, later], dim=-1), dim=-1)
    out = (w[..., :1] * o0.reshape(b, h // g, g, s, d).to(acc) + w[..., 1:2] * v[:, :, None].to(acc)
           + torch.einsum("bkgsj,bksjd->bkgsd", w[..., 2:], past.v.to(acc)))
    return out.reshape(b, h, s, d).to(q.dtype)
