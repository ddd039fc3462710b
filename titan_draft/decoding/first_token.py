"""A draft's first drafted token along a given decode, teacher-forced: where acceptance goes.

A round of speculative decoding starts by drafting a token after every committed one; the first
drafted token's acceptance is the largest term of tau. Along the target's own decode of a prompt
(greedy, or sampled at some temperature), :func:`forced_first_tokens` runs at every position the
round a speculative loop would run there -- the draft has committed the prompt and every decoded
token so far, exactly as after a round whose last token was that one -- and reads the draft's
distribution of its first token, ``q``, against the target's distribution of the next decoded
token, ``p``, both at the given temperature:

- ``sum_v min(p_v, q_v)``: the probability that speculative sampling accepts the first draft
  there (``decoding/sampling.py``);
- whether ``q``'s and ``p``'s argmaxes agree: greedy acceptance of the first draft;
- ``p``'s top-1 probability and entropy: how certain the target itself is there.

Reading the same draft along greedy and along sampled decodes separates what sampling changes in
the contexts a draft sees from what it changes in the rule that accepts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from titan_draft.decoding.sampling import tempered_probs
from titan_draft.decoding.speculative import begin_rounds, commit_rows
from titan_draft.protocols.proposer import Proposer

TOP1_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.97, 1.0)
"""Buckets of the target's top-1 probability: positions of equal certainty, compared across
decodes and drafts (``scripts/first_token.py``, ``scripts/compare_first_token.py``)."""


def top1_bucket(x: float, edges=TOP1_EDGES) -> int | None:
    """The index of the bucket of ``edges`` that holds ``x``: each holds its lower edge, the last
    also its upper one; None outside them all."""
    for k, (lo, hi) in enumerate(zip(edges, edges[1:])):
        if lo <= x < hi or (hi == edges[-1] and x == hi):
            return k
    return None


@dataclass
class FirstTokens:
    """Per decoded position after the first (the first is the prefill's): lists of equal length."""

    accept: list[float] = field(default_factory=list)
    """``sum_v min(p_v, q_v)`` at the temperature."""
    argmax_match: list[bool] = field(default_factory=list)
    target_top1: list[float] = field(default_factory=list)
    """The target's top-1 probability at the temperature."""
    target_entropy: list[float] = field(default_factory=list)
    """In nats, at the temperature."""


@torch.no_grad()
def forced_first_tokens(target, proposer: Proposer, prompt: list[int], tokens: list[int], device: torch.device, *,
                        temperature: float, generator: torch.Generator | None = None) -> FirstTokens:
    """The first drafted token of a round at each position of ``tokens`` (the target's decode of
    ``prompt``) after the first, against the target's next token there (module docstring).

    Args:
        target: the target, as ``speculative_decode`` calls it.
        proposer: the draft's proposer; it drafts from ``q = softmax(z / temperature)`` and hands
            ``q`` over (``draft_probs``).
        temperature: > 0.
        generator: the proposer's draws (they do not change the first token's ``q``).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (the first draft's q), got {temperature}")
    out = FirstTokens()
    cache, _ = begin_rounds(target, proposer, prompt, len(tokens), device, temperature, generator)
    for j in range(len(tokens) - 1):
        proposer.propose(tokens[j])
        if proposer.draft_probs is None:
            raise ValueError(f"{type(proposer).__name__} handed over no draft distribution at T = {temperature:g}")
        q = proposer.draft_probs[0]
        # the round's last token is forced to the decode's: the target reads it alone (the
        # loop's verify pass would read it with the drafts, then crop them)
        inp = torch.tensor([tokens[j]], device=device)
        step = target(inp[None], proposer.capture_layers, proposer.needs_last_hidden, cache=cache, logits="all")
        commit_rows(proposer, inp, step, 1)
        p = tempered_probs(step.logits[0, -1], temperature)
        q = q.to(p)
        out.accept.append(float(torch.minimum(p, q).sum()))
        out.argmax_match.append(int(q.argmax()) == int(p.argmax()))
        out.target_top1.append(float(p.max()))
        out.target_entropy.append(float(-(p * torch.log(p.clamp(min=torch.finfo(p.dtype).tiny))).sum()))
    return out
