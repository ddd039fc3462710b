"""Decode steps replayed as CUDA graphs give what eager decoding gives (GPU only), and the
wrapper is left out wherever graphs cannot run (CPU, DTensor parameters)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.qwen3 import Qwen3Model, qwen3_flavors
from titan_draft.components.cuda_graphs import GraphedDecoder, can_graph, maybe_graphed

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
