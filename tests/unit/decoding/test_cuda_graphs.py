"""Decode steps and training captures replayed as CUDA graphs give what eager runs give (GPU
only), and the wrappers are left out wherever graphs cannot run (CPU, dynamic shapes, DTensor
parameters), with the reason in their log line."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.targets.qwen3 import Qwen3Model, qwen3_flavors
from titan_draft.distributed.cuda_graphs import GraphedDecoder, can_graph, maybe_graphed
from titan_draft.features.graphed_capture import GraphedCapture, maybe_graphed_capture

LAYERS = [0, 2, 5]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _target(device) -> Qwen3Model:
    args = replace(qwen3_flavors["debugmodel"], vocab_size=211)
    with torch.device(device):
        m = Qwen3Model(args).eval()
    m.init_weights(seed=3)
    return m.requires_grad_(False)


def _ids(n: int, seed: int, device="cpu") -> torch.Tensor:
    return torch.randint(0, 211, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)


def test_left_out_where_graphs_cannot_run():
    target = _target("cpu")
    assert can_graph(target, torch.device("cpu")) == "not on a CUDA device"
    assert maybe_graphed(target, torch.device("cpu")) is target
    for kw, why in (({"enable": True, "static_shapes": True}, "not on a CUDA device"),
                    ({"enable": False, "static_shapes": True}, "target.cuda_graph is false"),
                    ({"enable": True, "static_shapes": False}, "training.static_shapes is false")):
        got, line = maybe_graphed_capture(target, torch.device("cpu"), **kw)
        assert got is target and "eager" in line and why in line
    got, line = maybe_graphed_capture(target, torch.device("cuda"), enable=True, static_shapes=True)
    assert isinstance(got, GraphedCapture) and "CUDA graph" in line


@cuda
@torch.no_grad()
def test_replayed_rounds_equal_eager_rounds():
    """A prefill, verify passes of 5 tokens with rejected ones cropped, single steps: every
    replay at a new length gives the eager cache's logits and features."""
    dev = torch.device("cuda")
    target = _target(dev)
    graphed = GraphedDecoder(target)
    ids = _ids(80, 0, dev)
    eager_cache, graph_cache = target.new_cache(1, 100), graphed.new_cache(1, 100)
    assert graph_cache.max_len % 256 == 0
    for t in (target, graphed):
        t(ids[:, :40], LAYERS, True, cache=eager_cache if t is target else graph_cache, logits="last")
    pos = 40  # a prefill longer than MAX_GRAPH_TOKENS: eager, no graph
    for accept in (2, 4, 0, 1, 3, 4):
        block = ids[:, pos : pos + 5]
        a = target(block, LAYERS, True, cache=eager_cache, logits="all")
        b = graphed(block, LAYERS, True, cache=graph_cache, logits="all")
        for x, y in ((a.logits, b.logits), (a.aux, b.aux), (a.last_hidden, b.last_hidden)):
            torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4)
        assert graph_cache.length == eager_cache.length == pos + 5
        pos += accept + 1
        eager_cache.crop(pos)
        graph_cache.crop(pos)
        one = ids[:, pos : pos + 1]
        a = target(one, cache=eager_cache, logits="last", need_last_hidden=False)
        b = graphed(one, cache=graph_cache, logits="last", need_last_hidden=False)
        torch.testing.assert_close(b.logits, a.logits, rtol=1e-4, atol=1e-4)
        pos += 1
    assert len(graphed._graphs) == 2  # one per shape, replayed at every length


@cuda
@torch.no_grad()
def test_a_larger_cache_recaptures():
    """Asking for more rows than the cache has makes a new cache and new graphs (regeneration's
    last, smaller or larger batch), whose replays are right too."""
    dev = torch.device("cuda")
    target = _target(dev)
    graphed = GraphedDecoder(target)
    for batch in (2, 3, 2):
        ids = torch.randint(0, 211, (batch, 41), device=dev)
        cache = graphed.new_cache(batch, 50, pad=torch.zeros(batch, dtype=torch.long, device=dev))
        graphed(ids[:, :40], cache=cache, logits="none")
        got = graphed(ids[:, 40:], cache=cache, logits="last", need_last_hidden=False).logits
        torch.testing.assert_close(got[:, -1], target(ids)[:, -1], rtol=1e-4, atol=1e-4)


@cuda
@torch.no_grad()
def test_padded_batch_reuses_the_cache_with_new_padding():
    dev = torch.device("cuda")
    target = _target(dev)
    graphed = GraphedDecoder(target)
    for lengths in ((5, 11, 8), (9, 3, 12)):
        rows = [_ids(n, n, dev)[0] for n in lengths]
        width = max(lengths)
        pad = torch.tensor([width - n for n in lengths], device=dev)
        batch = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long, device=dev), r]) for r in rows])
        cache = graphed.new_cache(3, width + 6, pad=pad)
        step = graphed(batch, cache=cache, logits="last", need_last_hidden=False)
        seq = [batch]
        for _ in range(4):
            nxt = step.logits[:, -1].argmax(-1, keepdim=True)
            seq.append(nxt)
            step = graphed(nxt, cache=cache, logits="last", need_last_hidden=False)
        full = torch.cat(seq, 1)
        for b, n in enumerate(lengths):
            alone = target(full[b : b + 1, width - n :])
            torch.testing.assert_close(step.logits[b, -1], alone[0, -1], rtol=1e-4, atol=1e-4)


@cuda
@torch.no_grad()
def test_graphed_capture_equals_the_compiled_eager_capture():
    """The training capture (compiled layer call, bf16) replayed from its graph gives the eager
    call's features bit for bit, for each new batch copied in; the features handed out earlier
    are not overwritten by the next replay; a shape past max_shapes runs eagerly."""
    dev = torch.device("cuda")
    target = _target(dev).to(torch.bfloat16)
    target.compile_capture()
    graphed = GraphedCapture(target, max_shapes=1)
    batches = [torch.randint(0, 211, (4, 96), generator=torch.Generator().manual_seed(i)).to(dev) for i in range(3)]
    got = [graphed.capture(b, LAYERS, True) for b in batches]
    for b, (aux, last) in zip(batches, got):
        ref_aux, ref_last = target.capture(b, LAYERS, True)
        assert torch.equal(aux, ref_aux) and torch.equal(last, ref_last)
    assert not torch.equal(got[0][0], got[1][0])  # each batch its own features, not the last replay's
    other = torch.randint(0, 211, (2, 64), device=dev)
    aux, last = graphed.capture(other, LAYERS, False)
    ref_aux, ref_last = target.capture(other, LAYERS, False)
    assert last is None and ref_last is None and torch.equal(aux, ref_aux)
    assert len(graphed._graphs) == 1
