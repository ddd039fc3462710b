"""DFlash / DFlash2 at decode time: one block forward drafts ``block_size - 1`` tokens.

The block is ``[anchor, MASK x (b - 1)]`` at positions ``n .. n + b - 1`` where ``n`` is the number
of committed tokens whose target features are known and the anchor is the newest committed token
(the target's bonus token, features not yet known): exactly a training block whose context is
every position strictly before its anchor. The context keys and values of every draft layer do
not depend on the block, so they are cached and extended as tokens are committed.

Slot ``k >= 1`` predicts the token ``k`` places after the anchor (slot 0 is not a prediction, as
in training). DFlash takes each slot's argmax; DFlash2's candidate selector walks the unary
top-K left to right from the anchor, each pick becoming the next slot's predecessor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.common import transform_logits
from models.dflash2.model import DFlash2Draft


class DFlashProposer:
    """:class:`~titan_draft.protocols.proposer.Proposer` of a plain (unsharded, eval-mode)
    :class:`DFlash2Draft` with its frozen tables loaded."""

    def __init__(self, draft: DFlash2Draft, max_len: int = 0):
        if draft.target_lm_head.shape[0] == 0:
            raise RuntimeError("DFlashProposer: call load_frozen_tables() on the draft first")
        a = draft.args
        self.draft = draft
        self.num_draft_tokens = a.block_size - 1
        self.capture_layers = list(a.target_layer_ids)
        self.needs_last_hidden = False
        weight = draft.fc.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.acc_dtype = torch.promote_types(self.dtype, torch.float32)
        self._k = self._v = None
        self.length = 0
        self.reset(max_len)

    def reset(self, max_len: int) -> None:
        self.length = 0
        self._reserve(max_len)

    def _reserve(self, max_len: int) -> None:
        """Room for ``max_len`` context positions (kept across sequences; grown by doubling)."""
        if self._k is not None and self._k.shape[3] >= max_len:
            return
        a = self.draft.args
        size = max(max_len, 2 * self._k.shape[3] if self._k is not None else 0)
        shape = (a.num_layers, 1, a.num_key_value_heads, size, a.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self._k is not None:
            k[:, :, :, : self.length] = self._k[:, :, :, : self.length]
            v[:, :, :, : self.length] = self._v[:, :, :, : self.length]
        self._k, self._v = k, v

    def _positions(self, n: int) -> torch.Tensor:
        return torch.arange(self.length, self.length + n, device=self.device)[None]

    @torch.no_grad()
    def commit(self, token_ids: torch.Tensor, aux: torch.Tensor, last_hidden: torch.Tensor | None = None) -> None:
        n = aux.shape[0]
        end = self.length + n
        self._reserve(end)
        d = self.draft
        ctx = d.hidden_norm(d.fc(aux[None].to(self.dtype)))
        rope = d.rope(self._positions(n), self.acc_dtype)
        for i, layer in enumerate(d.layers.values()):
            k, v = layer.self_attn.keys_values(ctx, rope)
            self._k[i, :, :, self.length:end] = k
            self._v[i, :, :, self.length:end] = v
        self.length = end

    @torch.no_grad()
    def block_hidden(self, last_token: int) -> torch.Tensor:
        """Final-norm hidden states ``[b, H]`` of the block anchored at ``last_token``."""
        d, a = self.draft, self.draft.args
        b = a.block_size
        ids = torch.full((1, b), a.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, 0] = last_token
        x = F.embedding(ids, d.target_embed).to(self.dtype)
        rope = d.rope(self._positions(b), self.acc_dtype)
        for i, layer in enumerate(d.layers.values()):
            ctx_kv = (self._k[i, :, :, : self.length], self._v[i, :, :, : self.length])
            x = layer(x, ctx_kv, rope, rope, None)  # the block sees all its context and itself
        return d.norm(x)[0]

    @torch.no_grad()
    def propose(self, last_token: int) -> torch.Tensor:
        d, a = self.draft, self.draft.args
        hidden = self.block_hidden(last_token)[1:]  # slots 1 .. b - 1
        w = d.target_lm_head
        logits = transform_logits((hidden.to(w.dtype) @ w.t()).to(self.acc_dtype),
                                  a.output_multiplier, a.final_logit_softcapping)
        if not a.selector_enabled:
            return logits.argmax(dim=-1)
        return self._selector_walk(hidden, logits, last_token)

    def _selector_walk(self, hidden: torch.Tensor, logits: torch.Tensor, last_token: int) -> torch.Tensor:
        """Greedy walk over each slot's unary top-K: the pick of slot k is slot k + 1's
        predecessor (the anchor is slot 1's), as in training's teacher-forced scores."""
        a = self.draft.args
        values, cands = logits.topk(a.selector_top_k, dim=-1)  # [b - 1, K]
        picks = []
        prev = torch.tensor([last_token], device=self.device)
        for k in range(hidden.shape[0]):
            scores = self.draft.candidate_selector(hidden[k : k + 1], prev, cands[k : k + 1], values[k : k + 1])
            prev = cands[k, scores[0].argmax()].view(1)
            picks.append(prev)
        return torch.cat(picks)
