"""Decode speed of a target, eager against CUDA graphs, in one run.

    python scripts/bench_decode.py --target outputs/targets/smollm2 [--batch 1024] [--context 600]

Three cases, each timed eagerly and through ``GraphedDecoder`` on the same cache contents:
a greedy step at batch 1 (T = 1), a verify pass of a 16-token block at batch 1 (T = 16), and a
regeneration step at batch ``--batch`` over ``--context`` left-padded cached tokens. Medians of
``--iters`` calls after ``--warmup``, with the ratio eager / graphs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_draft.components.cuda_graphs import GraphedDecoder  # noqa: E402
from titan_draft.components.target import load_target  # noqa: E402


def _median_ms(fn, cache, start: int, warmup: int, iters: int) -> float:
    times = []
    for i in range(warmup + iters):
        cache.crop(start)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def bench_case(target, batch: int, context: int, new: int, warmup: int, iters: int, logits: str) -> tuple[float, float]:
    """``(eager ms, graphs ms)`` of one cached forward of ``new`` tokens after ``context``."""
    dev = next(target.parameters()).device
    vocab = target.args.vocab_size
    ctx = torch.randint(0, vocab, (batch, context), device=dev)
    step = torch.randint(0, vocab, (batch, new), device=dev)
    pad = torch.zeros(batch, dtype=torch.long, device=dev) if batch > 1 else None
    out = []
    for graphed in (False, True):
        runner = GraphedDecoder(target) if graphed else target
        cache = runner.new_cache(batch, context + new, pad=pad) if graphed else \
            target.new_cache(batch, context + new, pad=pad)
        runner(ctx, cache=cache, logits="none", need_last_hidden=False)
        out.append(_median_ms(lambda: runner(step, cache=cache, logits=logits, need_last_hidden=False),
                              cache, context, warmup, iters))
        del runner, cache
    return out[0], out[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=1024, help="rows of the regeneration case")
    p.add_argument("--context", type=int, default=600, help="cached tokens before the timed call")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode: needs a CUDA device (CUDA graphs)")
    target = load_target(a.target, dtype=getattr(torch, a.dtype), device="cuda")
    cases = [("greedy step, batch 1", 1, 1, "last"), ("verify 16 tokens, batch 1", 1, 16, "all"),
             (f"regeneration step, batch {a.batch}", a.batch, 1, "last")]
    print(f"| case ({a.dtype}, {a.context} cached tokens) | eager ms | graphs ms | eager / graphs | graphs tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, batch, new, logits in cases:
        eager, graphs = bench_case(target, batch, a.context, new, a.warmup, a.iters, logits)
        tokens = batch * (new if logits == "last" and batch > 1 else 1)
        print(f"| {name} | {eager:.2f} | {graphs:.2f} | {eager / graphs:.2f}x | {tokens / graphs * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
