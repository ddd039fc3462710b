"""EAGLE-3 at decode time: a greedy chain of ``num_draft_tokens`` steps of the midlayer.

Position t's step-0 entry is built from the target's features g_t and the next token x_{t+1},
so the newest committed position waits for its next token: ``propose(x_n)`` completes the entry
of position n - 1 (kept in the context cache: both are committed), which is also step 0 of the
chain; step j then feeds its own token and pre-norm output at RoPE position n - 1 + j, seeing
the context plus the chain's own keys: the training-time test's mask, at the last position.
"""

from __future__ import annotations

import torch

from models.eagle3.model import Eagle3Draft


class Eagle3Proposer:
    """:class:`~titan_draft.protocols.proposer.Proposer` of a plain, eval-mode Eagle3Draft."""

    def __init__(self, draft: Eagle3Draft, num_draft_tokens: int | None = None):
        if draft.target_lm_head.shape[0] == 0:
            raise RuntimeError("Eagle3Proposer: call load_frozen_tables() on the draft first")
        a = draft.args
        self.draft = draft
        self.num_draft_tokens = num_draft_tokens or a.ttt_steps
        self.capture_layers = list(a.target_layer_ids)
        self.needs_last_hidden = False
        w = draft.fc.weight
        self.dtype, self.device = w.dtype, w.device
        self.acc_dtype = torch.promote_types(self.dtype, torch.float32)
        self.ids = draft.draft_ids()
        self.reset(0)

    def reset(self, max_len: int) -> None:
        a = self.draft.args
        size = max(max_len, 16)
        shape = (1, a.num_key_value_heads, size, a.head_dim)
        self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.length = 0  # positions whose step-0 entry is in the cache
        self.pending: torch.Tensor | None = None  # fused features of the newest position

    def _context(self) -> list:
        return [(self._k[:, :, : self.length], self._v[:, :, : self.length])] if self.length else []

    def _append(self, kv) -> None:
        if self.length == self._k.shape[2]:  # grow by doubling
            self._k = torch.cat([self._k, torch.zeros_like(self._k)], dim=2)
            self._v = torch.cat([self._v, torch.zeros_like(self._v)], dim=2)
        self._k[:, :, self.length : self.length + 1] = kv[0]
        self._v[:, :, self.length : self.length + 1] = kv[1]
        self.length += 1

    def _step(self, position: int, token: int, hidden: torch.Tensor, chain: list):
        """One midlayer row at ``position`` (its token, ``hidden [1, 1, H]``) over the context
        cache and the chain's earlier keys: ``(pre-norm output, its keys and values)``."""
        d = self.draft
        rope = d.rope(torch.tensor([[position]], device=self.device), self.acc_dtype)
        emb = d.embed(torch.tensor([[token]], device=self.device), self.dtype)
        return d.midlayer(emb, hidden, rope, self._context() + chain, None)

    @torch.no_grad()
    def commit(self, token_ids: torch.Tensor, aux: torch.Tensor, last_hidden: torch.Tensor | None = None) -> None:
        """Positions of ``token_ids`` now have features ``aux``: each position whose next token is
        known (the waiting one, then all but the newest) gets its step-0 entry."""
        fused = self.draft.fuse(aux[None])  # [1, n, H]
        tokens = token_ids.tolist()
        waiting = [self.pending] if self.pending is not None else []
        rows = waiting + [fused[:, i : i + 1] for i in range(len(tokens) - 1)]
        nexts = tokens if waiting else tokens[1:]
        for hidden, nxt in zip(rows, nexts):
            _, kv = self._step(self.length, nxt, hidden, [])
            self._append(kv)
        self.pending = fused[:, -1:]

    @torch.no_grad()
    def chain(self, last_token: int, forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """Draft tokens (target ids) and each step's pre-norm output; ``forced`` feeds given
        tokens to steps 1.. instead of the chain's own picks (tests compare with training)."""
        if self.pending is None:
            raise RuntimeError("Eagle3Proposer: commit the prompt before proposing")
        d = self.draft
        position = self.length  # the newest committed position, n - 1
        out, kv = self._step(position, last_token, self.pending, [])
        self._append(kv)  # last_token is committed: this entry is context from now on
        self.pending = None
        picks, outs, chain = [], [out], []
        for j in range(self.num_draft_tokens):
            logits = d.lm_head(d.norm(out)).to(self.acc_dtype)[0, -1]
            picks.append(int(self.ids[logits.argmax()]))
            if j + 1 == self.num_draft_tokens:
                break
            token = forced[j] if forced is not None else picks[-1]
            out, kv = self._step(position + 1 + j, token, out, chain)
            chain.append(kv)
            outs.append(out)
        return picks, outs

    def propose(self, last_token: int) -> torch.Tensor:
        picks, _ = self.chain(last_token)
        return torch.tensor(picks, dtype=torch.long, device=self.device)
