"""EAGLE-3 at decode time: a greedy chain of ``num_draft_tokens`` steps of the midlayer.

Position t's step-0 entry is built from the target's features g_t and the next token x_{t+1},
so the newest committed position waits for its next token: ``propose(x_n)`` completes the entry
of position n - 1 (kept in the context cache: both are committed), which is also step 0 of the
chain; step j then feeds its own token and pre-norm output at RoPE position n - 1 + j, seeing
the context plus the chain's own keys: the training-time test's mask, at the last position.

Every proposal has the same shapes: the context cache is preallocated (rounded like the
block-diffusion decoder's, ``models/block_diffusion/decoder.py``), the committed length, the
newest token and the waiting features live on the device, and each step attends to all cache
slots under a mask of the filled ones. So on a CUDA device the whole chain (step 0's entry
written into the cache at the device-side length, every step, every pick) is captured once as a
CUDA graph and replayed (the default on a CUDA device; ``graphs=False`` drafts eagerly): eagerly,
a chain of 7 steps launches a few hundred small kernels at batch 1, which made EAGLE-3's eval pay
for its own launches where DFlash's replays. On an H200 (SmolLM2 flavor, bf16, batch 1,
``scripts/bench_decode.py --proposals eagle3``) a proposal takes 9.48 ms eagerly, 1.14 ms replayed;
``tests/gpu/test_proposals_gpu.py`` checks the replay against the eager chain. ``commit`` (a
varying number of rows) stays eager: one projection of all its rows into keys and values.
"""

from __future__ import annotations

import torch

from models.eagle3.model import Eagle3Draft
from models.common.sampling import DraftSampler
from titan_draft.distributed.cuda_graphs import capture_graph, clone_outputs, maybe_graphs, round_slots


class Eagle3Proposer:
    """:class:`~titan_draft.protocols.proposer.Proposer` of a plain, eval-mode Eagle3Draft.

    Args:
        draft: the draft (frozen tables loaded).
        num_draft_tokens: chain length (None: the draft's ``ttt_steps``).
        graphs: replay proposals as CUDA graphs (needs a CUDA device); None: on a CUDA device.
    """

    def __init__(self, draft: Eagle3Draft, num_draft_tokens: int | None = None, graphs: bool | None = None):
        if draft.target_lm_head.shape[0] == 0:
            raise RuntimeError("Eagle3Proposer: call load_frozen_tables() on the draft first")
        a = draft.args
        self.draft = draft
        self.num_draft_tokens = num_draft_tokens or a.ttt_steps
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        self.capture_layers = list(a.target_layer_ids)
        self.needs_last_hidden = False
        w = draft.fc.weight
        self.dtype, self.device = w.dtype, w.device
        self.acc_dtype = torch.promote_types(self.dtype, torch.float32)
        self.graphs = maybe_graphs(graphs, self.device, "Eagle3Proposer")
        self.ids = draft.draft_ids()
        self._k = self._v = None
        self._len = torch.zeros((), dtype=torch.long, device=self.device)
        self._token = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        self._pending = torch.zeros(1, 1, a.hidden_size, dtype=self.dtype, device=self.device)
        # the chain's own keys and the query's: always visible
        self._chain_visible = torch.ones(self.num_draft_tokens, dtype=torch.bool, device=self.device)
        self._graph = None
        self.sampler = DraftSampler(self.num_draft_tokens, self.device)
        self.draft_probs: torch.Tensor | None = None
        self.reset(0)

    def set_sampling(self, temperature: float, generator: torch.Generator | None = None) -> None:
        """Draft the greedy chain (``temperature`` 0) or sample each step from its tempered
        distribution, the next step reading the drawn token (Proposer protocol)."""
        if self.sampler.set(temperature, generator):
            self._graph = None

    def reset(self, max_len: int) -> None:
        self.length = 0  # positions whose step-0 entry is in the cache
        self._len.fill_(0)
        self.has_pending = False  # whether _pending holds the newest position's fused features
        self._reserve(max_len + 1)

    def _reserve(self, size: int) -> None:
        """Room for ``size`` step-0 entries (kept across sequences; grown by doubling)."""
        if self._k is not None and self._k.shape[2] >= size:
            return
        a = self.draft.args
        old = 0 if self._k is None else self._k.shape[2]
        size = round_slots(max(size, 2 * old, 1))  # a larger reservation re-captures the graph
        shape = (1, a.num_key_value_heads, size, a.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self._k is not None:
            k[:, :, : self.length] = self._k[:, :, : self.length]
            v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v
        self._slots = torch.arange(size, device=self.device)
        self._graph = None  # bound to the old buffers

    @torch.no_grad()
    def commit(self, token_ids: torch.Tensor, aux: torch.Tensor, last_hidden: torch.Tensor | None = None) -> None:
        """Positions of ``token_ids`` now have features ``aux``: each position whose next token is
        known (the waiting one, then all but the newest) gets its step-0 entry: its keys and
        values, all rows at once (an entry's keys do not depend on what it attends to)."""
        d = self.draft
        fused = d.fuse(aux[None])  # [1, n, H]
        token_ids = token_ids.to(self.device)
        rows = fused[:, :-1]
        nexts = token_ids[1:]
        if self.has_pending:
            rows, nexts = torch.cat([self._pending, rows], dim=1), token_ids
        r, p = rows.shape[1], self.length
        self._reserve(p + r + 1)  # + the entry the next proposal completes
        if r:
            # only the entries' keys and values are kept: no attention, no MLP
            rope = d.rope(torch.arange(p, p + r, device=self.device)[None], self.acc_dtype)
            k, v = d.midlayer.keys_values(d.embed(nexts[None], self.dtype), rows, rope)
            self._k[:, :, p : p + r] = k
            self._v[:, :, p : p + r] = v
            self.length += r
        self._pending.copy_(fused[:, -1:])
        self.has_pending = True
        self._len.fill_(self.length)

    def _step(self, position: torch.Tensor, token: torch.Tensor, hidden: torch.Tensor, chain: list,
              filled: torch.Tensor):
        """One midlayer row at ``position [1, 1]`` (``token [1, 1]``, ``hidden [1, 1, H]``) over the
        cache slots ``filled`` says are in the context, then the chain's earlier keys and its own:
        ``(pre-norm output, its keys and values)``."""
        d = self.draft
        rope = d.rope(position, self.acc_dtype)
        emb = d.embed(token, self.dtype)
        visible = torch.cat([filled, self._chain_visible[: len(chain) + 1]])
        return d.midlayer(emb, hidden, rope, [(self._k, self._v)] + chain, visible.view(1, 1, 1, -1))

    def _chain(self, forced: torch.Tensor | None = None):
        """``(picks [n] (target ids), logits [n, Vd], each step's pre-norm output)`` of the chain
        after the token in ``_token``; step 0's entry is written into the cache slot ``_len``.
        ``forced [n - 1]`` feeds given tokens to steps 1.. instead of the picks. Device tensors
        only: it may be a graph."""
        d = self.draft
        position = self._len.view(1, 1)  # the newest committed position, n - 1
        out, (k, v) = self._step(position, self._token, self._pending, [], self._slots < self._len)
        # last_token is committed: this entry is context from now on
        self._k.index_copy_(2, self._len.view(1), k)
        self._v.index_copy_(2, self._len.view(1), v)
        filled = self._slots <= self._len
        picks, logits, outs, chain = [], [], [out], []
        for j in range(self.num_draft_tokens):
            logits.append(d.lm_head(d.norm(out)).to(self.acc_dtype)[0, -1])
            # argmax, or a draw from softmax(z / T); a 1-element index (a 0-dim one would sync)
            picks.append(self.ids[self.sampler.pick(logits[-1][None], j)])
            if j + 1 == self.num_draft_tokens:
                break
            token = picks[-1] if forced is None else forced[j]
            out, kv = self._step(position + 1 + j, token.view(1, 1), out, chain, filled)
            chain.append(kv)
            outs.append(out)
        return torch.cat(picks), torch.stack(logits), outs

    def _start_chain(self, last_token: int) -> None:
        if not self.has_pending:
            raise RuntimeError("Eagle3Proposer: commit the prompt before proposing")
        self._token.fill_(last_token)
        self.sampler.draw_uniforms()

    def _end_chain(self) -> None:
        self.length += 1
        self._len.fill_(self.length)
        self.has_pending = False

    @torch.no_grad()
    def chain(self, last_token: int, forced: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
        """Draft tokens (target ids) and each step's pre-norm output, eagerly; ``forced`` feeds
        given tokens to steps 1.. instead of the chain's own picks (tests compare with training)."""
        self._start_chain(last_token)
        forced_t = None if forced is None else torch.tensor(forced, dtype=torch.long, device=self.device)
        picks, _, outs = self._chain(forced_t)
        self._end_chain()
        return picks.tolist(), outs

    @torch.no_grad()
    def propose_with_logits(self, last_token: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(draft tokens [n], each step's logits over the draft vocabulary [n, Vd])``, replayed
        from the CUDA graph when ``graphs``."""
        self._start_chain(last_token)
        if not self.graphs:
            picks, logits, _ = self._chain()
        else:
            if self._graph is None:
                # the warm-up runs and the capture write step 0's entry into the slot the real
                # call writes, with the same inputs: nothing committed is touched
                self._graph = capture_graph(lambda: self._chain()[:2])
            graph, out = self._graph
            graph.replay()
            picks, logits = clone_outputs(out)
        self._end_chain()
        return picks, logits

    @property
    def settings(self) -> dict:
        return {"num_draft_tokens": self.num_draft_tokens}

    def propose(self, last_token: int) -> torch.Tensor:
        picks, logits = self.propose_with_logits(last_token)
        self.draft_probs = None
        if self.sampler.sampling:  # q over the target vocabulary: zero outside the draft's
            q = self.sampler.probs(logits)
            self.draft_probs = q.new_zeros(q.shape[0], self.draft.target_lm_head.shape[0])
            self.draft_probs[:, self.ids] = q
        return picks
