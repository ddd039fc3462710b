"""DFlash2's candidate selector: a low-rank transition score over the unary top-K."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CandidateSelector(nn.Module):
    """``score(c) = unary[c] + < A[prev] * (P h), B[c] >`` for the K unary candidates of a row.

    ``A`` (predecessor codebook) embeds the previous token, ``P`` projects the draft hidden
    state, ``B`` (successor codebook) embeds each candidate. ``B`` starts at zero, so the score
    starts equal to the unary logits (plain DFlash).

    Args:
        dim: draft hidden size H.
        vocab_size: V (rows of both codebooks).
        rank: r.
    """

    def __init__(self, dim: int, vocab_size: int, rank: int):
        super().__init__()
        self.hidden_projection = nn.Linear(dim, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))

    def forward(
        self,
        hidden: torch.Tensor,
        prev_ids: torch.Tensor,
        cand_ids: torch.Tensor,
        unary: torch.Tensor,
    ) -> torch.Tensor:
        """Scores ``[M, K]`` in ``unary``'s dtype.

        Args:
            hidden: ``[M, H]`` final-norm draft states.
            prev_ids: ``[M]`` predecessor token of each row.
            cand_ids: ``[M, K]`` candidate token ids (the unary top-K).
            unary: ``[M, K]`` unary logits of the candidates.
        """
        acc = unary.dtype
        query = F.embedding(prev_ids, self.predecessor_codebook).to(acc)
        query = query * self.hidden_projection(hidden).to(acc)  # [M, r]
        succ = F.embedding(cand_ids, self.successor_codebook).to(acc)  # [M, K, r]
        return unary + torch.einsum("mr,mkr->mk", query, succ)

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.hidden_projection.weight, std=std)
        nn.init.normal_(self.predecessor_codebook, std=std)
        nn.init.zeros_(self.successor_codebook)
