"""The target's KV cache: a cached decode gives what the uncached forward gives (fp64), for
the slicing cache and for the fixed-shape one that CUDA graphs replay (``static``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.targets.qwen3 import Qwen3Model, qwen3_flavors

LAYERS = [0, 2, 5]


@pytest.fixture(scope="module", params=[True, False], ids=["qwen3", "llama"])
def target(request) -> Qwen3Model:
    args = replace(qwen3_flavors["debugmodel"], vocab_size=211, qk_norm=request.param)
    m = Qwen3Model(args).double().eval()
    m.init_weights(seed=3)
    return m


@pytest.fixture(params=[False, True], ids=["sliced", "static"])
def static(request) -> bool:
    return request.param


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 211, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_chunked_decode_equals_full_forward(target, static):
    ids = _ids(23)
    logits = target(ids)
    aux, last = target.capture(ids, LAYERS, True)
    cache = target.new_cache(1, 40, static=static)
    steps = [target(ids[:, a:b], LAYERS, True, cache=cache, logits="all")
             for a, b in ((0, 9), (9, 10), (10, 16), (16, 23))]
    assert cache.length == 23
    torch.testing.assert_close(torch.cat([s.logits for s in steps], 1), logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([s.aux for s in steps], 1), aux, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([s.last_hidden for s in steps], 1), last, rtol=0, atol=1e-12)


@torch.no_grad()
def test_last_and_no_logits(target, static):
    ids = _ids(12, 1)
    full = target(ids)
    cache = target.new_cache(1, 12, static=static)
    out = target(ids, None, False, cache=cache, logits="last")
    assert out.aux is None and out.last_hidden is None
    torch.testing.assert_close(out.logits, full[:, -1:], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="13 slots needed, the cache holds 12"):
        target(ids[:, :1], cache=cache, logits="none")
    with pytest.raises(ValueError, match="logits must be"):
        target(ids[:, :1], cache=target.new_cache(1, 4, static=static), logits="first")


@torch.no_grad()
def test_crop_forgets_rejected_tokens(target, static):
    """What a rejected draft wrote is gone after crop: extending with other tokens gives the
    forward of the new sequence."""
    ids, wrong = _ids(20, 2), _ids(9, 3)  # 3 more than the extension: stale slots stay
    cache = target.new_cache(1, 32, static=static)
    target(ids[:, :14], cache=cache, logits="none")
    target(wrong, cache=cache, logits="none")
    cache.crop(14)
    out = target(ids[:, 14:], LAYERS, False, cache=cache, logits="all")
    torch.testing.assert_close(out.logits, target(ids)[:, 14:], rtol=0, atol=1e-12)
    torch.testing.assert_close(out.aux, target.capture(ids, LAYERS, False)[0][:, 14:], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="outside"):
        cache.crop(cache.length + 1)


@torch.no_grad()
def test_left_padded_batch_equals_each_row_alone(target, static):
    """Batched generation: rows of different lengths, left-padded, decode as if alone."""
    rows = [_ids(n, 10 + n)[0] for n in (5, 11, 8)]
    width = max(len(r) for r in rows)
    pad = torch.tensor([width - len(r) for r in rows])
    batch = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    cache = target.new_cache(3, width + 4, pad=pad, static=static)
    first = target(batch, LAYERS, False, cache=cache, logits="last")
    nxt = first.logits[:, -1].argmax(-1, keepdim=True)
    second = target(nxt, LAYERS, False, cache=cache, logits="last")
    for b, r in enumerate(rows):
        alone = torch.cat([r, nxt[b]])[None]
        full = target(alone)
        torch.testing.assert_close(first.logits[b, -1], full[0, -2], rtol=0, atol=1e-12)
        torch.testing.assert_close(second.logits[b, -1], full[0, -1], rtol=0, atol=1e-12)
        aux = target.capture(alone, LAYERS, False)[0][0]
        torch.testing.assert_close(first.aux[b, pad[b]:], aux[:-1], rtol=0, atol=1e-12)
        assert torch.isfinite(first.aux[b]).all()  # pad slots stay finite
