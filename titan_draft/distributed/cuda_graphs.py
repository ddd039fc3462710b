"""Decode steps of a target replayed as CUDA graphs, and the capture helpers every graphed path uses
(the training-time target capture: ``titan_draft/features/graphed_capture.py``; a block-diffusion
draft's proposal: ``models/block_diffusion/decoder.py``).

At batch 1 a small target is bound by the host: SmolLM2's 30 layers launch ~750 kernels per
token, ~25 ms of Python and launches against ~1 ms of GPU work. :class:`GraphedDecoder` wraps a
target so that every cached forward of a few tokens (a greedy step, a verify pass of a draft
block, a batched regeneration step) is captured once per shape and then replayed: one launch.
The target must hand out a fixed-shape cache (``new_cache(..., static=True)``, see
``models/targets/qwen3/static_cache.py``); prefills and uncached forwards run eagerly as before.

The wrapper keeps one cache and reuses it for the next sequence (graphs are bound to its
memory): ``new_cache`` resets it, or makes a larger one (and drops the graphs) when asked for
more rows or slots than it has.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

# Longer inputs (prefills) run eagerly: each new length would be a new graph.
MAX_GRAPH_TOKENS = 32
# Cache slots are rounded up to this, so sequences of similar length share graphs.
SLOT_ROUNDING = 256


def maybe_graphs(graphs: bool | None, device: torch.device, owner: str) -> bool:
    """Whether a proposer replays CUDA graphs: ``graphs``, or on a CUDA device when None; a
    ValueError naming ``owner`` when asked for graphs off a CUDA device."""
    use = device.type == "cuda" if graphs is None else bool(graphs)
    if use and device.type != "cuda":
        raise ValueError(f"{owner}: graphs=True needs a CUDA device, the draft is on {device}")
    return use


def round_slots(n: int) -> int:
    """``n`` cache slots rounded up to a multiple of ``SLOT_ROUNDING``."""
    return -(-n // SLOT_ROUNDING) * SLOT_ROUNDING


def clone_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of a graph's output buffer (the next replay overwrites it), or None."""
    return None if t is None else t.clone()


def clone_outputs(out):
    """Copies of a graph's outputs: one tensor, or a tuple / list of them."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    return type(out)(t.clone() for t in out)


class CapturedGraph:
    """A captured graph, its input buffer, its output buffers and the tokens one replay adds."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: torch.Tensor, out, num_new: int):
        self.graph, self.inputs, self.out, self.num_new = graph, inputs, out, num_new


class GraphedDecoder:
    """``target``'s cached decode steps as CUDA graphs (module docstring); otherwise the same
    calls (``__call__``, ``new_cache``) as the target."""

    def __init__(self, target):
        self.target = target
        self.cache = None
        self._graphs: dict[tuple, CapturedGraph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def new_cache(self, batch: int, max_len: int, pad: torch.Tensor | None = None):
        slots = round_slots(max_len)
        c = self.cache
        if c is None or c.batch != batch or c.max_len < slots or (c.pad is None) != (pad is None):
            self._graphs.clear()
            # a pool whose graphs are all gone must not be captured into again (the caching
            # allocator asserts on it): the next graphs get a new one
            self._pool = torch.cuda.graph_pool_handle()
            self.cache = None
            self.cache = c = self.target.new_cache(batch, slots, pad=pad, static=True)
        elif pad is not None:
            c.pad.copy_(pad)
        c.set_length(0)
        return c

    def __call__(self, input_ids: torch.Tensor, layer_ids=None, need_last_hidden: bool = True, *,
                 cache=None, logits: str = "all"):
        if cache is None or cache is not self.cache or input_ids.shape[1] > MAX_GRAPH_TOKENS:
            return self.target(input_ids, layer_ids, need_last_hidden, cache=cache, logits=logits)
        key = (tuple(input_ids.shape), tuple(layer_ids or ()), need_last_hidden, logits)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._graphs[key] = self._capture(input_ids, layer_ids, need_last_hidden, logits)
        captured.inputs.copy_(input_ids)
        captured.graph.replay()
        cache.note_replayed(captured.num_new)
        out = captured.out
        # the next replay overwrites the graph's outputs
        return replace(out, logits=clone_or_none(out.logits), aux=clone_or_none(out.aux), last_hidden=clone_or_none(out.last_hidden))

    def _capture(self, input_ids, layer_ids, need_last_hidden, logits) -> CapturedGraph:
        """The runs write keys into the slots the real call is about to write (so nothing
        committed is touched) and the length is put back after each."""
        cache, start = self.cache, self.cache.length
        inputs = input_ids.clone()
        graph, out = capture_graph(
            lambda: self.target(inputs, layer_ids, need_last_hidden, cache=cache, logits=logits),
            pool=self._pool, after_each=lambda: cache.set_length(start))
        return CapturedGraph(graph, inputs, out, input_ids.shape[1])


def capture_graph(fn, *, pool=None, after_each=None):
    """``(graph, outputs)`` of ``fn()`` captured as a CUDA graph: two warm-up runs on a side
    stream first (lazy initializations must not happen inside the capture), ``after_each`` after
    every run (e.g. undoing what a run advanced). ``pool``: a memory pool shared with other graphs
    (None: a fresh one, as capturing into a pool whose graphs are gone trips the allocator)."""
    after_each = after_each or (lambda: None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
            after_each()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool if pool is not None else torch.cuda.graph_pool_handle(),
                          capture_error_mode="thread_local"):
        out = fn()
    after_each()
    return graph, out


def can_graph(target, device: torch.device) -> str | None:
    """Why ``target`` cannot be graphed on ``device`` (None: it can)."""
    if device.type != "cuda":
        return "not on a CUDA device"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return "sharded over several ranks (every forward is a collective)"
    if any(isinstance(p, DTensor) for p in target.parameters()):
        return "its parameters are DTensors (FSDP hooks run in every forward)"
    if not getattr(target, "cuda_graphs", True):
        return getattr(target, "cuda_graphs_why", "the target opts out of CUDA graphs")
    return None


def maybe_graphed(target, device: torch.device, enable: bool = True):
    """``GraphedDecoder(target)`` where it can be (``can_graph``) and ``enable``; else ``target``."""
    if not enable or can_graph(target, device) is not None:
        return target
    return GraphedDecoder(target)
