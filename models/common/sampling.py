"""Drawing draft tokens at T > 0 inside a proposal that may be a CUDA graph.

Speculative sampling needs each drafted token drawn from the draft's own tempered distribution
q = softmax(z / T), and q itself for the verify rule. A graph cannot call the sampler's random
stream, so the uniforms are drawn on the host from the eval's seeded generator into a static
buffer before each proposal (:class:`DraftSampler`), and the pick is the inverse CDF of q at them
(``torch.searchsorted``): no host read, the same seed gives the same tokens.
"""

from __future__ import annotations

import torch


def inverse_cdf_pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``probs [n, V]`` (rows summing to ~1), ``u [n]`` in [0, 1) -> ``[n]`` int64: the first
    index whose cumulative probability exceeds ``u * row sum`` (an index of zero probability is
    never picked)."""
    c = probs.cumsum(dim=-1)
    target = (u.to(c.dtype) * c[:, -1]).unsqueeze(-1)
    return torch.searchsorted(c, target, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


class DraftSampler:
    """The sampling setting of one proposer: ``temperature`` 0 drafts the greedy chain (point
    masses, no ``q``); > 0 draws from ``softmax(z / T)`` with uniforms from ``generator``.

    Args:
        slots: most draws one proposal makes.
        device: where the proposal runs.
    """

    def __init__(self, slots: int, device: torch.device):
        self.temperature = 0.0
        self.generator: torch.Generator | None = None
        self.u = torch.zeros(slots, dtype=torch.float64, device=device)

    def set(self, temperature: float, generator: torch.Generator | None) -> bool:
        """Set the setting; True when the proposal's graph must be captured again (the greedy and
        the sampled proposals are different graphs, and T is baked into the sampled one)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        changed = float(temperature) != self.temperature
        self.temperature, self.generator = float(temperature), generator
        return changed

    @property
    def sampling(self) -> bool:
        return self.temperature > 0

    def draw_uniforms(self) -> None:
        """Fresh uniforms for the next proposal (on the host, from the generator)."""
        if self.sampling:
            self.u.copy_(torch.rand(self.u.shape, generator=self.generator, dtype=torch.float64))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``softmax(logits / T)`` in the logits' float dtype (float32 at least)."""
        dtype = torch.promote_types(logits.dtype, torch.float32)
        return torch.softmax(logits.to(dtype) / self.temperature, dim=-1)

    def pick(self, logits: torch.Tensor, slot: int) -> torch.Tensor:
        """``logits [1, V]`` -> ``[1]``: the argmax at T = 0, else a draw from the tempered
        distribution with the ``slot``-th uniform."""
        if not self.sampling:
            return logits.argmax(dim=-1)
        return inverse_cdf_pick(self.probs(logits), self.u[slot : slot + 1])
