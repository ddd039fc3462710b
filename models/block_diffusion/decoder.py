"""A block-diffusion draft decoding one sequence next to its target (the DFlash family, DSpark).

The block ``[anchor, MASK x (b - 1)]`` at positions ``n .. n + b - 1`` attends to the context of
the ``n`` committed tokens whose target features are known, exactly a training block whose
context is everything strictly before its anchor. The context keys and values of every layer do
not depend on the block, so they are cached and extended as tokens commit.

Every proposal has the same shapes: the context buffers are preallocated, the committed length
and the anchor token live on the device, and the block attends to all context slots under a mask
of the filled ones. So on a GPU a proposer's whole ``propose`` (block forward, lm_head, the walk
over the slots) can be captured once as a CUDA graph and replayed (``graphs=True``): at batch 1
the eager forward is bound by kernel launches (a DFlash2 round spent ~15 ms of host time
drafting against ~4 ms for the target's graphed verify pass). It is the default on a CUDA
device: on the H200 (2026-12-01) graphed proposals equalled eager ones
(``tests/unit/models/dflash2/test_models_dflash2_proposal.py``) and a SmolLM2 DFlash2 proposal took 1.45 ms instead of
11.99 (``scripts/bench_decode.py``); ``--proposer-option graphs=false`` drafts eagerly.

The commit of a round's tokens (their context keys and values, every layer) then became the
draft's larger share of a round: 1.2-1.3 ms eagerly for DFlash2 and DSpark on the same H200 against
~1.1 ms for the replayed proposal. ``graph_commit=True`` gives it fixed shapes too: a round
commits at most ``num_draft_tokens + 1`` tokens, so every such commit computes that many rows
(the round's, then whatever the input buffer held before) and writes them at the device-side
length; only the round's rows are counted, and the rest, past the length, are masked out of every
block and overwritten by the next commit. Replayed as a CUDA graph with ``graphs``; eagerly it is
the same computation (what the CPU tests check against the plain commit). Longer commits (the
prompt) run the plain commit. It is the default wherever proposals replay (``graph_commit=None``):
on an H200 (2026-12-05, SmolLM2, bf16) a draft round took 1.64-1.72 ms with it against 2.92-3.70
for DFlash2 and 1.28-1.37 against 2.56-3.93 for DSpark, and speculative decoding ran 14-18 %
faster at the same tau (``docs/benchmarks/2026-12-05-graph-commit.md``). Eagerly (CPU) the plain
commit stays the default: there the fixed width only adds rows.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from models.common.sampling import DraftSampler
from titan_draft.distributed.cuda_graphs import capture_graph, clone_outputs, maybe_graphs, round_slots


class BlockDecoder:
    """A :class:`~models.block_diffusion.draft.BlockDiffusionDraft` (plain, unsharded, eval mode,
    tables loaded) decoding one sequence (module docstring).

    Args:
        draft: the draft.
        graphs: replay proposals as CUDA graphs (needs a CUDA device); None: on a CUDA device.
        graph_commit: commit a round's tokens with fixed shapes, replayed as a CUDA graph with
            ``graphs`` (module docstring); None: where proposals replay (``graphs``).
    """

    def __init__(self, draft, graphs: bool | None = None, graph_commit: bool | None = None):
        if draft.target_lm_head.shape[0] == 0:
            raise RuntimeError(f"{type(self).__name__}: call load_frozen_tables() on the draft first")
        self.draft = draft
        weight = draft.fc.weight
        self.dtype, self.device = weight.dtype, weight.device
        self.acc_dtype = torch.promote_types(self.dtype, torch.float32)
        self.graphs = maybe_graphs(graphs, self.device, type(self).__name__)
        b = draft.args.block_size
        self._k = self._v = None
        self.length = 0
        self._len = torch.zeros((), dtype=torch.long, device=self.device)
        self._anchor = torch.zeros(1, dtype=torch.long, device=self.device)
        self._masks = torch.full((b - 1,), draft.args.mask_token_id, dtype=torch.long, device=self.device)
        self._block_slots = torch.arange(b, device=self.device)
        self._graph = None
        self.graph_commit = self.graphs if graph_commit is None else bool(graph_commit)
        self._commit_graph = None
        self._commit_rows = None  # [num_draft_tokens + 1, K*H]: the fixed commit's input
        self.sampler = DraftSampler(b, self.device)
        self.draft_probs: torch.Tensor | None = None

    def set_sampling(self, temperature: float, generator: torch.Generator | None = None) -> None:
        """Draft the greedy chain (``temperature`` 0) or sample from the tempered draft
        distributions with ``generator``'s uniforms (Proposer protocol)."""
        if self.sampler.set(temperature, generator):
            self._graph = None

    def reset(self, max_len: int) -> None:
        self.length = 0
        self._len.fill_(0)
        self._reserve(max_len)

    def _reserve(self, max_len: int) -> None:
        """Room for ``max_len`` context positions (kept across sequences; grown by doubling)."""
        if self._k is not None and self._k.shape[3] >= max_len:
            return
        a = self.draft.args
        size = max(max_len, 2 * self._k.shape[3] if self._k is not None else 0, 1)
        size = round_slots(size)  # a larger reservation re-captures the graph
        shape = (a.num_layers, 1, a.num_key_value_heads, size, a.head_dim)
        k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        v = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self._k is not None:
            k[:, :, :, : self.length] = self._k[:, :, :, : self.length]
            v[:, :, :, : self.length] = self._v[:, :, :, : self.length]
        self._k, self._v = k, v
        # context slots, then the block's own b: a block row sees the filled context and its block
        self._kv_slots = torch.arange(size + a.block_size, device=self.device)
        self._graph = self._commit_graph = None  # bound to the old buffers

    @torch.no_grad()
    def commit(self, token_ids: torch.Tensor, aux: torch.Tensor, last_hidden: torch.Tensor | None = None) -> None:
        """Extend the context by ``aux [n, K*H]`` (the target's features of ``n`` committed
        tokens): each layer's keys and values of them, computed once."""
        n = aux.shape[0]
        end = self.length + n
        width = self.num_draft_tokens + 1 if self.graph_commit else 0
        if 0 < n <= width:
            self._reserve(self.length + width)
            if self._commit_rows is None:
                self._commit_rows = torch.zeros(width, aux.shape[1], dtype=self.dtype, device=self.device)
            self._commit_rows[:n].copy_(aux)
            self._run(self._commit_fixed, "_commit_graph")
            self.length = end
            self._len.fill_(end)
            return
        self._reserve(end)
        d = self.draft
        ctx = d.context(aux[None])
        positions = torch.arange(self.length, end, device=self.device)[None]
        rope = d.rope(positions, self.acc_dtype)
        for i, layer in enumerate(d.layers.values()):
            k, v = layer.self_attn.keys_values(ctx, rope)
            self._k[i, :, :, self.length:end] = k
            self._v[i, :, :, self.length:end] = v
        self.length = end
        self._len.fill_(end)

    def _commit_fixed(self) -> None:
        """Keys and values of every row of the fixed commit's input buffer at positions
        ``length ..``, the length read on the device (graph-safe)."""
        d = self.draft
        ctx = d.context(self._commit_rows[None])
        slots = self._len + torch.arange(ctx.shape[1], device=self.device)
        rope = d.rope(slots[None], self.acc_dtype)
        for i, layer in enumerate(d.layers.values()):
            k, v = layer.self_attn.keys_values(ctx, rope)
            self._k[i].index_copy_(2, slots, k)
            self._v[i].index_copy_(2, slots, v)

    @torch.no_grad()
    def block_hidden(self, last_token: int | None = None) -> torch.Tensor:
        """Final-norm hidden states ``[b, H]`` of the block anchored at ``last_token`` (None:
        the anchor :meth:`run_proposal` set, as inside a graph), over the committed context."""
        if last_token is not None:
            self._anchor.fill_(last_token)
        d = self.draft
        ids = torch.cat([self._anchor, self._masks])[None]
        x = F.embedding(ids, d.target_embed).to(self.dtype)
        rope = d.rope((self._len + self._block_slots)[None], self.acc_dtype)
        size = self._k.shape[3]
        visible = (self._kv_slots < self._len) | (self._kv_slots >= size)
        mask = visible.expand(1, 1, ids.shape[1], visible.shape[0])
        for i, layer in enumerate(d.layers.values()):
            x = layer(x, (self._k[i], self._v[i]), rope, rope, mask)
        return d.norm(x)[0]

    @torch.no_grad()
    def run_proposal(self, last_token: int, propose: Callable[[], torch.Tensor | tuple]) -> torch.Tensor | tuple:
        """``propose()`` (which reads the anchor, the length and the buffers, nothing from the
        host; it returns a tensor or a tuple of them) anchored at ``last_token``: run eagerly,
        or replayed from its CUDA graph."""
        self._anchor.fill_(last_token)
        self.sampler.draw_uniforms()
        return self._run(propose, "_graph")

    def _run(self, fn: Callable[[], torch.Tensor | tuple | None], slot: str):
        """``fn()`` eagerly, or replayed from the CUDA graph kept in attribute ``slot`` (captured
        on first use); the outputs copied (the next replay overwrites them)."""
        if not self.graphs:
            return fn()
        if getattr(self, slot) is None:
            setattr(self, slot, capture_graph(fn))
        graph, out = getattr(self, slot)
        graph.replay()
        return None if out is None else clone_outputs(out)
