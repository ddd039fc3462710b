"""Speculative *sampling* at temperature T > 0, and the plain sampling it must equal in distribution.

Greedy speculative decoding (``speculative.py``) is checked token for token. At T > 0 the target's
output is random, so what must hold is that speculative decoding draws every sequence with the
probability plain sampling gives it (the rejection rule of Leviathan et al. / Chen et al.). With
p_i the target's tempered distribution after the i-th input of the verify pass and q_i the draft
distribution the i-th drafted token d_i was drawn from (given the drafts before it):

- accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
- at the first rejection, draw the round's last token from the residual max(p_i - q_i, 0),
  renormalized;
- if all n drafts are accepted, draw the bonus token from p_n.

Then P(first new token = t) = min(q_0(t), p_0(t)) + (1 - sum_v min(p_0, q_0)(v)) * residual_0(t)
= p_0(t), and so on along the sequence: the output is distributed exactly as plain sampling's, and
a draft's chance of acceptance is sum_v min(p_i, q_i)(v) = 1 - TV(p_i, q_i). Proposers that sample
(``Proposer.set_sampling``) hand over their q_i (``draft_probs``); a proposer that drafts its greedy
chain is a point mass on d_i, for which the rule reads: accept with p_i(d_i), residual p_i with d_i
removed. tau is counted as in the greedy loop (tokens produced by verification rounds / rounds).
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


def rejection_terms(draft: torch.Tensor, probs: torch.Tensor,
                    q: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule's exact terms (module docstring), what :func:`verify_sampled` draws with:
    ``(accept [n], residual [n + 1, V])``: draft i is accepted with probability ``accept[i]``;
    at the first rejection, at i, the round's last token is drawn from ``residual[i]``;
    ``residual[n]`` is the bonus distribution ``probs[n]``. ``q`` as in :func:`verify_sampled`."""
    n = draft.numel()
    rows = torch.arange(n, device=probs.device)
    if q is None:
        q = torch.zeros_like(probs[:n]).index_put_((rows, draft), torch.ones(n, dtype=probs.dtype))
    q = q.to(probs)
    if q.shape != probs[:n].shape:
        raise ValueError(f"draft distributions of shape {tuple(q.shape)} for {n} drafts over {probs.shape[-1]} tokens")
    q_draft = q[rows, draft]
    # min(1, p / q) -> 1 as q -> 0: a float32 q may round a drawn token's tiny mass to 0
    accept = torch.where(q_draft > 0, probs[rows, draft] / q_draft.clamp(min=torch.finfo(probs.dtype).tiny), 1.0)
    accept = accept.clamp(max=1.0)
    residual = probs.clone()
    residual[:n] = (probs[:n] - q).clamp(min=0.0)
    mass = residual[:n].sum(dim=-1, keepdim=True)
    # mass 0 (q = p, or p a point mass on the draft): accept is 1, the row is never drawn from
    residual[:n] = torch.where(mass > 0, residual[:n] / mass.clamp(min=torch.finfo(probs.dtype).tiny), probs[:n])
    return accept, residual


def verify_sampled(draft: torch.Tensor, probs: torch.Tensor, generator: torch.Generator | None = None,
                   q: torch.Tensor | None = None) -> tuple[int, int]:
    """One round's rejection rule (module docstring).

    Args:
        draft: ``[n]`` drafted tokens.
        probs: ``[n + 1, V]`` the target's tempered distributions after each verify input (the
            committed token, then each drafted token).
        generator: the sampling stream (CPU).
        q: ``[n, V]`` the distributions the drafts were drawn from; None: point masses (greedy
            drafts).

    Returns:
        ``(m, token)``: the number of accepted drafts and the round's own last token (the
        residual draw at the first rejection, else the bonus draw from ``probs[n]``).
    """
    n = draft.numel()
    accept, residual = rejection_terms(draft, probs, q)
    u = torch.rand(n, generator=generator, dtype=probs.dtype, device=probs.device)
    for i in range(n):
        if u[i] >= accept[i]:
            return i, _draw(residual[i], generator)
    return n, _draw(probs[n], generator)


def sample_decode(target, prompt: list[int], max_new_tokens: int, stop_ids, device: torch.device, *,
                  temperature: float, generator: torch.Generator | None = None) -> Generation:
    """Plain sampling at ``temperature`` with a KV cache, one token per target forward."""
    return greedy_decode(target, prompt, max_new_tokens, stop_ids, device, rule=SampledRule(temperature, generator))


def plain_decode(target, prompt: list[int], max_new_tokens: int, stop_ids, device: torch.device, *,
                 temperature: float, seed: int) -> Generation:
    """The target's own decode of ``prompt``: greedy at ``temperature`` 0, else plain sampling
    from a generator seeded ``seed`` (the eval seeds prompt i's with its ``--seed`` + i)."""
    if temperature <= 0:
        return greedy_decode(target, prompt, max_new_tokens, stop_ids, device)
    return sample_decode(target, prompt, max_new_tokens, stop_ids, device, temperature=temperature,
                         generator=torch.Generator().manual_seed(seed))


class SampledRule:
    """The T > 0 rule for ``speculative.speculative_decode`` (module docstring)."""

    def __init__(self, temperature: float, generator: torch.Generator | None = None):
        tempered_probs(torch.zeros(1), temperature)  # refuses T <= 0 at once
        self.temperature, self.generator = temperature, generator

    def first(self, logits: torch.Tensor) -> int:
        return _draw(tempered_probs(logits, self.temperature).cpu(), self.generator)

    def verify(self, draft: torch.Tensor, logits: torch.Tensor, q: torch.Tensor | None = None) -> tuple[int, list[int]]:
        draft = draft.cpu()
        probs = tempered_probs(logits, self.temperature).cpu()
        m, token = verify_sampled(draft, probs, self.generator, None if q is None else q.cpu())
        return m, draft[:m].tolist() + [token]


def speculative_sample(target, proposer: Proposer, prompt: list[int], max_new_tokens: int, stop_ids,
                       device: torch.device, *, temperature: float,
                       generator: torch.Generator | None = None) -> Generation:
    """Speculative sampling (module docstring) of ``prompt`` with ``proposer``'s drafts."""
    return speculative_decode(target, proposer, prompt, max_new_tokens, stop_ids, device,
                              rule=SampledRule(temperature, generator))
