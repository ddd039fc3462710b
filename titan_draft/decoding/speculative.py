"""Greedy speculative decoding against a real target, and the plain greedy decoding it must equal.

One sequence at a time (batch 1), both with a KV cache on the target. A speculative round:
the draft proposes up to ``n`` tokens after the newest committed token ``x``; the target runs once
on ``[x, d_1 .. d_n]``, its greedy choice after each of them is compared with the next draft
token, the longest agreeing prefix ``d_1 .. d_m`` is accepted and the target's own choice after
``d_m`` (the bonus token) is appended, so every round yields ``m + 1`` tokens. The cache entries of
the rejected tokens are cropped and the draft is given the target's features of the ``m + 1``
positions it now knows.

τ (acceptance length) = tokens produced by verification rounds / verification rounds: the token
the prefill produces is counted by neither, and tokens cut off at a stop token or at
``max_new_tokens`` are not counted. Lossless means the speculative tokens equal the plain
greedy tokens one for one; where floating-point rounding (bf16) lets two near-equal logits swap
between the two computations they part ways, and :func:`compare` reports the logit margin there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from titan_draft.protocols.proposer import Proposer


@dataclass
class Generation:
    """One decoded sequence."""

    tokens: list[int]
    """New tokens after the prompt, up to and including the first stop token."""
    wall_s: float
    """Wall-clock seconds of the whole decode (prefill included), device-synchronized."""
    rounds: int = 0
    """Target verification passes (speculative decoding only)."""
    accepted: list[int] = field(default_factory=list)
    """Draft tokens accepted in each round (the bonus token not included)."""
    proposed: list[int] = field(default_factory=list)
    """Draft tokens proposed in each round."""
    sampled_rounds: int = 0
    """Rounds whose drafts were drawn from the draft's distributions (verified with them)."""
    margins: list[float] = field(default_factory=list)
    """Plain greedy only: top-1 minus top-2 logit of every step (how near a tie each choice was)."""

    @property
    def round_tokens(self) -> int:
        """Tokens produced by verification rounds (all but the prefill's)."""
        return max(len(self.tokens) - 1, 0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cut(tokens: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> tuple[list[int], bool]:
    """``tokens`` up to the first stop token (inclusive) and at most ``max_new_tokens``; and
    whether decoding is over."""
    for i, t in enumerate(tokens[:max_new_tokens]):
        if t in stop_ids:
            return tokens[: i + 1], True
    tokens = tokens[:max_new_tokens]
    return tokens, len(tokens) >= max_new_tokens


@torch.no_grad()
def greedy_decode(target, prompt: list[int], max_new_tokens: int, stop_ids, device: torch.device,
                  rule=None) -> Generation:
    """Plain decoding with a KV cache, one token per target forward: greedy (with every step's
    top-2 margin), or the token ``rule.first`` picks (e.g. sampling)."""
    stop = frozenset(stop_ids)
    _sync(device)
    start = time.perf_counter()
    cache = target.new_cache(1, len(prompt) + max_new_tokens)
    inp = torch.tensor([prompt], device=device)
    tokens: list[int] = []
    margins: list[float] = []
    while len(tokens) < max_new_tokens and not (tokens and tokens[-1] in stop):
        logits = target(inp, cache=cache, logits="last", need_last_hidden=False).logits[0, -1].float()
        if rule is None:
            top = logits.topk(2)
            margins.append(float(top.values[0] - top.values[1]))
            tokens.append(int(top.indices[0]))
        else:
            tokens.append(rule.first(logits))
        inp = torch.tensor([[tokens[-1]]], device=device)
    _sync(device)
    return Generation(tokens=tokens, wall_s=time.perf_counter() - start, margins=margins)


class GreedyRule:
    """How a round's tokens are chosen from the target's logits: the greedy rule (module
    docstring). ``speculative_sampling.SampledRule`` is the T > 0 one."""

    temperature = 0.0
    generator = None

    def first(self, logits: torch.Tensor) -> int:
        """The prefill's token from the logits ``[V]`` after the prompt."""
        return int(logits.argmax())

    def verify(self, draft: torch.Tensor, logits: torch.Tensor, q: torch.Tensor | None = None) -> tuple[int, list[int]]:
        """``(accepted drafts m, the round's m + 1 tokens)`` from ``draft [n]`` and the logits
        ``[n + 1, V]`` after the verify pass's inputs (``q``: None, greedy drafts)."""
        if q is not None:
            raise ValueError("greedy verification got draft distributions: the proposer is sampling at T = 0")
        choice = logits.argmax(dim=-1)  # the target's token after each input token
        n = draft.numel()
        # the round's one read of the device: drafts and choices together, compared on the host
        both = torch.cat([draft, choice]).tolist()
        drafted, chosen = both[:n], both[n:]
        m = next((i for i, (d, c) in enumerate(zip(drafted, chosen)) if d != c), n)
        return m, chosen[: m + 1]


def commit_rows(proposer: Proposer, inp: torch.Tensor, step, n: int) -> None:
    """Give the draft the first ``n`` tokens of the target's pass ``step`` over ``inp`` and their
    features (the final-norm hidden states too where the draft reads them)."""
    proposer.commit(inp[:n], step.aux[0, :n], step.last_hidden[0, :n] if proposer.needs_last_hidden else None)


def begin_rounds(target, proposer: Proposer, prompt: list[int], max_new_tokens: int, device: torch.device,
                 temperature: float, generator: torch.Generator | None):
    """A speculative decode's start: a target cache with room for the prompt, ``max_new_tokens``
    and one round's drafts, the proposer reset and drafting at ``temperature``, the prompt read
    by the target and committed to the draft. Returns ``(cache, the prefill's pass)``."""
    max_len = len(prompt) + max_new_tokens + proposer.num_draft_tokens + 1
    cache = target.new_cache(1, max_len)
    proposer.reset(max_len)
    proposer.set_sampling(temperature, generator)
    inp = torch.tensor(prompt, device=device)
    step = target(inp[None], proposer.capture_layers, proposer.needs_last_hidden, cache=cache, logits="last")
    commit_rows(proposer, inp, step, len(prompt))
    return cache, step


@torch.no_grad()
def speculative_decode(target, proposer: Proposer, prompt: list[int], max_new_tokens: int, stop_ids,
                       device: torch.device, rule=None) -> Generation:
    """Speculative decoding (module docstring) of ``prompt`` with ``proposer``'s drafts; greedy
    unless ``rule`` (``first``/``verify``, as :class:`GreedyRule`) says otherwise."""
    rule = GreedyRule() if rule is None else rule
    stop = frozenset(stop_ids)
    layers, need_last = proposer.capture_layers, proposer.needs_last_hidden
    _sync(device)
    start = time.perf_counter()
    cache, step = begin_rounds(target, proposer, prompt, max_new_tokens, device, rule.temperature, rule.generator)
    tokens, done = _cut([rule.first(step.logits[0, -1])], max_new_tokens, stop)
    out = Generation(tokens=tokens, wall_s=0.0)
    if max_new_tokens <= 0:
        out.tokens, done = [], True
    while not done:
        last = out.tokens[-1]
        draft = proposer.propose(last).to(device=device, dtype=torch.long).flatten()
        n = draft.numel()
        # the newest token joins the drafts by a fill on the device: a copy from the host's
        # pageable memory would wait for the proposal to finish before the verify is queued
        inp = torch.cat([draft.new_full((1,), last), draft])
        step = target(inp[None], layers, need_last, cache=cache, logits="all")
        q = proposer.draft_probs
        m, new = rule.verify(draft, step.logits[0], q)
        out.sampled_rounds += q is not None
        cache.crop(cache.length - (n - m))
        commit_rows(proposer, inp, step, m + 1)
        out.rounds += 1
        out.accepted.append(m)
        out.proposed.append(n)
        out.tokens, done = _cut(out.tokens + new, max_new_tokens, stop)
    _sync(device)
    out.wall_s = time.perf_counter() - start
    return out


@dataclass
class Divergence:
    """Where speculative and plain greedy output first differ."""

    index: int
    """Index among the new tokens."""
    greedy_token: int
    speculative_token: int
    margin: float
    """Plain greedy's top-1 minus top-2 logit at that step."""
    recomputed_margin: float
    """logit(greedy token) - logit(speculative token) from one uncached forward of the prompt
    and the common prefix (a third computation; ~0 at a true near-tie)."""


@torch.no_grad()
def compare(target, prompt: list[int], greedy: Generation, spec: Generation, device: torch.device) -> Divergence | None:
    """The first difference between ``greedy`` and ``spec`` (None: lossless), with its margins.
    A length difference without a differing token counts at the shorter one's end."""
    a, b = greedy.tokens, spec.tokens
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if index is None:
        if len(a) == len(b):
            return None
        index = min(len(a), len(b))
    g = a[index] if index < len(a) else -1
    s = b[index] if index < len(b) else -1
    margin = greedy.margins[index] if index < len(greedy.margins) else float("nan")
    recomputed = float("nan")
    if g >= 0 and s >= 0:
        ids = torch.tensor([prompt + a[:index]], device=device)
        cache = target.new_cache(1, ids.shape[1])  # the decode path's (fp32) logits, one pass
        logits = target(ids, cache=cache, logits="last", need_last_hidden=False).logits[0, -1]
        recomputed = float(logits[g] - logits[s])
    return Divergence(index=index, greedy_token=g, speculative_token=s, margin=margin, recomputed_margin=recomputed)
