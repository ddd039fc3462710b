#!/usr/bin/env python3
"""The DFlash2 selector's top-K over the vocabulary, per CE chunk: ``torch.topk`` on ``[rows, V]``
bf16 logits against ``topk_by_group_max`` (models/common/cross_entropy.py) with several group
widths, in one run on one GPU. Prints the median of ``--iters`` timed calls after ``--warmup``
(CUDA events) and checks that every variant returns torch.topk's values.

    python scripts/bench_topk.py                        # 2048 x 151936 (Qwen3), K = 16 and 8
    python scripts/bench_topk.py --vocab 128256         # Llama-3

The whole step with it: ``scripts/benchmark.py --drafts dflash2 ... -- --model.args.selector_topk_group 128``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from models.common.cross_entropy import topk_by_group_max  # noqa: E402


def _csv_ints(value: str) -> list[int]:
    return [int(v) for v in value.split(",") if v]


def median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=2048, help="rows per CE chunk (model.args.ce_chunk_rows)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--k", type=_csv_ints, default=[16, 8], help="comma list of K")
    p.add_argument("--groups", type=_csv_ints, default=[64, 128, 256], help="comma list of group widths")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_topk: needs a CUDA device")
    z = torch.randn(args.rows, args.vocab, device="cuda").bfloat16()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, logits [{args.rows}, {args.vocab}] bf16, "
          f"median of {args.iters} after {args.warmup}")
    for k in args.k:
        ref = z.topk(k, dim=-1).values
        base = median_ms(lambda: z.topk(k, dim=-1), args.warmup, args.iters)
        print(f"K={k:3d}  torch.topk             {base:7.3f} ms")
        for group in args.groups:
            top, idx = topk_by_group_max(z, k, group)
            if not (torch.equal(top, ref) and torch.equal(z.gather(1, idx), ref)):
                raise SystemExit(f"group {group}: values differ from torch.topk")
            t = median_ms(lambda g=group: topk_by_group_max(z, k, g), args.warmup, args.iters)
            print(f"K={k:3d}  group max, width {group:4d} {t:7.3f} ms  ({base / t:.2f}x)")


if __name__ == "__main__":
    main()
