"""Speculative *sampling* at temperature T > 0, and the plain sampling it must equal in distribution.

Greedy speculative decoding (``speculative.py``) is checked token for token. At T > 0 the target's
output is random, so what must hold is that speculative decoding draws every sequence with the
probability plain sampling gives it (the rejection rule of Leviathan et al. / Chen et al.). Our
proposers draft deterministically (their greedy chain), i.e. the draft distribution q_i is a point
mass on the drafted token d_i, for which the rule reads: with p_i the target's tempered
distribution after the i-th input of the verify pass,

- accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i);
- at the first rejection, draw the round's last token from the residual max(p_i - q_i, 0),
  renormalized, which is p_i with d_i removed;
- if all n drafts are accepted, draw the bonus token from p_n.

Then P(first new token = t) = p_0(d_0) [t = d_0] + (1 - p_0(d_0)) p_0(t) / (1 - p_0(d_0)) [t != d_0]
= p_0(t), and so on along the sequence: the output is distributed exactly as plain sampling's.
τ is counted as in the greedy loop (tokens produced by verification rounds / rounds).
"""

from __future__ import annotations

import torch

from titan_draft.decoding.speculative import Generation, greedy_decode, speculative_decode
from titan_draft.protocols.proposer import Proposer


def tempered_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / T)`` in float32 (float64 inputs stay float64)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return torch.softmax(logits.to(dtype) / temperature, dim=-1)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_sampled(draft: torch.Tensor, probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[int, int]:
    """One round's rejection rule (module docstring) for deterministic drafts.

    Args:
        draft: ``[n]`` drafted tokens.
        probs: ``[n + 1, V]`` the target's tempered distributions after each verify input (the
            committed token, then each drafted token).
        generator: the sampling stream (CPU).

    Returns:
        ``(m, token)``: the number of accepted drafts and the round's own last token (the
        residual draw at the first rejection, else the bonus draw from ``probs[n]``).
    """
    n = draft.numel()
    u = torch.rand(n, generator=generator, dtype=probs.dtype, device=probs.device)
    p_draft = probs[torch.arange(n, device=probs.device), draft]
    for i in range(n):
        if u[i] >= p_draft[i]:
            residual = probs[i].clone()
            residual[draft[i]] = 0.0
            return i, _draw(residual / residual.sum(), generator)
    return n, _draw(probs[n], generator)


def sample_decode(target, prompt: list[int], max_new_tokens: int, stop_ids, device: torch.device, *,
                  temperature: float, generator: torch.Generator | None = None) -> Generation:
    """Plain sampling at ``temperature`` with a KV cache, one token per target forward."""
    return greedy_decode(target, prompt, max_new_tokens, stop_ids, device, rule=SampledRule(temperature, generator))


class SampledRule:
    """The T > 0 rule for ``speculative.speculative_decode`` (module docstring)."""

    def __init__(self, temperature: float, generator: torch.Generator | None = None):
        tempered_probs(torch.zeros(1), temperature)  # refuses T <= 0 at once
        self.temperature, self.generator = temperature, generator

    def first(self, logits: torch.Tensor) -> int:
        return _draw(tempered_probs(logits, self.temperature).cpu(), self.generator)

    def verify(self, draft: torch.Tensor, logits: torch.Tensor) -> tuple[int, list[int]]:
        draft = draft.cpu()
        m, token = verify_sampled(draft, tempered_probs(logits, self.temperature).cpu(), self.generator)
        return m, draft[:m].tolist() + [token]


def speculative_sample(target, proposer: Proposer, prompt: list[int], max_new_tokens: int, stop_ids,
                       device: torch.device, *, temperature: float,
                       generator: torch.Generator | None = None) -> Generation:
    """Speculative sampling (module docstring) of ``prompt`` with ``proposer``'s drafts."""
    return speculative_decode(target, proposer, prompt, max_new_tokens, stop_ids, device,
                              rule=SampledRule(temperature, generator))
