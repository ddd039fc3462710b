"""The frozen target's training-time capture replayed as one CUDA graph per batch shape
(``target.cuda_graph``)."""

from __future__ import annotations

import logging

import torch

from titan_draft.distributed.cuda_graphs import CapturedGraph, can_graph, capture_graph, clone_or_none

logger = logging.getLogger(__name__)


class GraphedCapture:
    """``target.capture`` of whole training micro-batches replayed as one CUDA graph per input
    shape; otherwise the target's own ``capture``.

    Online training runs the frozen target on every micro-batch. A small target leaves the GPU
    waiting on the host: SmolLM2's capture of 16 x 1024 tokens is ~5 ms of kernels behind ~14 ms
    of Python and launches a step on an H200 (profile of 2026-12-02, docs/performance.md). With
    static shapes every batch has one shape, so it is recorded once and replayed: one launch.
    The outputs are copied out of the graph's buffers, so callers may keep them past the next
    replay, as with eager outputs. At most ``max_shapes`` shapes get a graph (each holds its
    own memory); further shapes run eagerly, with a warning.
    """

    def __init__(self, target, max_shapes: int = 4):
        self.target = target
        self.max_shapes = max_shapes
        self._graphs: dict[tuple, CapturedGraph] = {}
        self._warned = False

    def capture(self, input_ids: torch.Tensor, layer_ids: list[int], need_last_hidden: bool = True,
                document_ids: torch.Tensor | None = None):
        """As the target's ``capture``; packed rows' ``document_ids`` are a graph input too (the
        document mask is built inside the graph from them)."""
        key = (tuple(input_ids.shape), tuple(layer_ids), need_last_hidden, document_ids is None)
        captured = self._graphs.get(key)
        if captured is None:
            if len(self._graphs) >= self.max_shapes:
                if not self._warned:
                    logger.warning("target capture: more than %d batch shapes (now %s); the new ones run eagerly "
                                   "(training.static_shapes keeps one shape)", self.max_shapes, key[0])
                    self._warned = True
                return self.target.capture(input_ids, layer_ids, need_last_hidden, document_ids=document_ids)
            inputs = (input_ids.clone(), clone_or_none(document_ids))
            graph, out = capture_graph(
                lambda: self.target.capture(inputs[0], layer_ids, need_last_hidden, document_ids=inputs[1]))
            captured = self._graphs[key] = CapturedGraph(graph, inputs, out, 0)
        captured.inputs[0].copy_(input_ids)
        if document_ids is not None:
            captured.inputs[1].copy_(document_ids)
        captured.graph.replay()
        aux, last = captured.out
        return aux.clone(), clone_or_none(last)


def maybe_graphed_capture(target, device: torch.device, *, enable: bool, static_shapes: bool):
    """``(target or GraphedCapture(target), line)``: the capture the training step calls, and one
    log line saying which it is and, when eager, why."""
    why = ("target.cuda_graph is false" if not enable
           else "training.static_shapes is false (a graph per batch length)" if not static_shapes
           else can_graph(target, device))
    if why is not None:
        return target, f"target capture: eager ({why})"
    return GraphedCapture(target), "target capture: one CUDA graph per batch shape (target.cuda_graph)"
