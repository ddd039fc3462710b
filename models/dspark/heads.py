"""DSpark's two small heads on the backbone's final-norm hidden states ``h_k``.

The Markov head makes the block's drafts depend on each other: slot k's logits are
``lm_head(h_k) + W2 f_k`` where the rank-r feature ``f_k`` depends on the previous token
``x_{k-1}`` (the anchor for slot 0). Training feeds the data's tokens as previous tokens
(teacher forcing); decoding feeds its own picks, left to right. The bias projection ``W2`` is
applied by the chunked loss (loss.py) or the proposer, never here: the ``[rows, V]`` bias is
never materialized for a whole block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.dspark.args import MARKOV_HEAD_TYPES, MARKOV_INITS


class MarkovHead(nn.Module):
    """``markov_w1`` (``[V, r]`` table of previous tokens), ``markov_w2`` (Linear r -> V, no bias)
    and, by type, ``gate_proj`` (Linear(H + r -> r) on ``[h_k; W1[x]]``) or ``joint_proj``
    (Linear(2r + H -> 3r) on ``[s_{k-1}; W1[x]; h_k]``, split into gate, candidate and output).

    Features ``f_k`` (the bias is ``W2 f_k``):
      vanilla: ``W1[x_{k-1}]``;
      gated:   ``sigmoid(gate_proj([h_k; W1[x_{k-1}]])) * W1[x_{k-1}]``;
      rnn:     ``z = [s_{k-1}; W1[x_{k-1}]; h_k]``, ``(g, c, o) = joint_proj(z)``,
               ``s_k = sigmoid(g) * s_{k-1} + (1 - sigmoid(g)) * tanh(c)``, ``f_k = tanh(o)``,
               ``s_{-1} = 0``.

    ``init`` 'zero_bias': ``W2`` starts at zero, so an initialized DSpark drafts what its backbone
    alone does; 'deepspec': every weight ``~ N(0, 0.02)`` (DeepSpec's init), biases zero.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, kind: str, init: str = "zero_bias"):
        super().__init__()
        if kind not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type {kind!r} is not one of {list(MARKOV_HEAD_TYPES)}")
        if init not in MARKOV_INITS:
            raise ValueError(f"markov_init {init!r} is not one of {list(MARKOV_INITS)}")
        self.kind, self.rank, self.init = kind, rank, init
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embedding(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev)

    def step(self, hidden: torch.Tensor, prev: torch.Tensor, state: torch.Tensor | None):
        """One slot for rows ``hidden [..., H]`` with previous tokens ``prev [...]``:
        ``(feature [..., r], W1[prev], next state)`` (the state is None except for 'rnn')."""
        e = self.markov_w1(prev)
        h = hidden.to(e.dtype)
        if self.kind == "vanilla":
            return e, e, None
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1)))
            return gate * e, e, None
        if state is None:
            state = e.new_zeros(e.shape)
        g, c, o = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        g = torch.sigmoid(g)
        return torch.tanh(o), e, g * state + (1 - g) * torch.tanh(c)

    def block_features(self, hidden: torch.Tensor, prev: torch.Tensor):
        """Teacher-forced features of whole blocks: ``hidden [M, b, H]``, ``prev [M, b]`` ->
        ``(features [M, b, r], W1[prev] [M, b, r])``. Only 'rnn' walks the slots in order."""
        if self.kind != "rnn":
            f, e, _ = self.step(hidden, prev, None)
            return f, e
        feats, embs, state = [], [], None
        for k in range(hidden.shape[1]):
            f, e, state = self.step(hidden[:, k], prev[:, k], state)
            feats.append(f)
            embs.append(e)
        return torch.stack(feats, dim=1), torch.stack(embs, dim=1)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.init == "deepspec":
            nn.init.normal_(self.markov_w1.weight, std=0.02)
            nn.init.normal_(self.markov_w2.weight, std=0.02)
        else:
            nn.init.normal_(self.markov_w1.weight, std=1.0)
            nn.init.zeros_(self.markov_w2.weight)
        for proj in (self._modules.get("gate_proj"), self._modules.get("joint_proj")):
            if proj is not None:
                nn.init.normal_(proj.weight, std=0.02)
                nn.init.zeros_(proj.bias)


class ConfidenceHead(nn.Module):
    """``c_k = sigmoid(proj([h_k; W1[x_{k-1}]]))`` (``proj`` Linear(H + r -> 1) with bias; H -> 1
    without the Markov input): the predicted probability that slot k's draft is accepted given
    its prefix was. Returns the logit; the loss applies the sigmoid inside its BCE."""

    def __init__(self, hidden_size: int, rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (rank if with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """``hidden [..., H]``, ``prev_emb [..., r]`` -> logits ``[...]``."""
        x = torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return F.linear(x.to(self.proj.weight.dtype), self.proj.weight, self.proj.bias).squeeze(-1)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)
