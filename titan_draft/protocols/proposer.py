"""How a draft proposes tokens while a real target decodes: the contract of the true-τ eval.

The eval (``titan_draft/decoding/speculative.py``) owns the target and the verification; a draft
only says which tokens it would draft next. It learns the committed text (and the target's
capture-layer features of it) through ``commit`` and drafts through ``propose``. Capture layers,
mask token, block size and slot convention are the draft's own args, the ones it was trained
with, so training and decoding cannot disagree about them.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Proposer(Protocol):
    """A draft decoding one sequence (batch 1) next to a target.

    Positions: after ``commit`` has been called with ``n`` tokens in all, the committed text is
    ``x_0 .. x_{n-1}`` and the target's features of all of them are known. ``propose(x_n)`` is
    then called with the newest committed token ``x_n``, whose features are not known yet (the
    target's last verification produced it as its bonus token).
    """

    num_draft_tokens: int
    """Most tokens one ``propose`` returns (DFlash: block_size - 1)."""

    capture_layers: list[int]
    """Target layer ids whose outputs ``commit`` receives (SGLang convention)."""

    needs_last_hidden: bool
    """Whether ``commit`` also receives the target's final-norm hidden states."""

    settings: dict
    """The decode-time choices that shape what it drafts, defaults resolved (e.g. how many tokens
    a round drafts, how a sampled token is drawn): the eval's report records them, so two reports
    say whether they decoded a draft the same way."""

    def reset(self, max_len: int) -> None:
        """Forget everything; the next sequence has at most ``max_len`` tokens."""

    def commit(self, token_ids: torch.Tensor, aux: torch.Tensor, last_hidden: torch.Tensor | None) -> None:
        """Append committed tokens ``token_ids [n]`` with the target's capture-layer outputs at
        their positions ``aux [n, K*H]`` (and ``last_hidden [n, H]`` when asked for)."""

    draft_probs: torch.Tensor | None
    """After a ``propose`` while sampling: ``[n, V]`` the draft distribution q_i (over the target
    vocabulary) each drafted token was drawn from, given the tokens drafted before it; None when
    the draft is deterministic (greedy chain: a point mass on each token)."""

    def set_sampling(self, temperature: float, generator: torch.Generator | None = None) -> None:
        """Draft the greedy chain (``temperature`` 0) or draw each token from the draft's
        ``softmax(z / temperature)`` with ``generator`` (the eval's seeded stream), setting
        ``draft_probs``. Called before each sequence."""

    def propose(self, last_token: int) -> torch.Tensor:
        """Draft tokens ``[<= num_draft_tokens]`` (int64) to follow ``last_token``."""
