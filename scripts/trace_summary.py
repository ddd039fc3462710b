"""Summarize a torch profiler trace: where the GPU time of the profiled step(s) goes.

    python scripts/trace_summary.py outputs/bench/profile/traces/NAME.pt.trace.json.gz [--top 25]

Prints the GPU busy time against the profiled wall time (the gaps are host overhead or syncs),
time per kernel category (matmuls, attention, elementwise/fused, reductions, optimizer, copies,
collectives), the top kernels, the GPU time of the host ops that launched them (with their
input shapes, which the job's profiler records: a kernel name alone rarely says which tensor it
was working on), and the host-device syncs seen (cudaStreamSynchronize, cudaDeviceSynchronize,
device-to-host copies), and per region the trainer names (``titan_draft.features``,
``.draft_forward``, ``.backward``, ``.optimizer``) its host time, its span on the GPU and the
kernel time inside that span: a region whose GPU span is much longer than its kernel time is
waiting for the host. The GPU's idle time inside the steps is charged to the host op under each
gap (a model op there: the host is too slow to keep the device fed), and the blocking runtime
calls are counted with the host time spent in them (time the host waited on the device). A GEMM
op's line also gives the rate its kernels' recorded time implies; with ``--peak-tflops`` the
summary says when some exceed it: then kernel records are missing or their durations are off,
and only the shares are worth reading (seen on an H200 with torch 2.11; float8 GEMMs have twice
the bf16 peak).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict

# first match wins; patterns are matched against the lower-cased kernel name
CATEGORIES = (
    ("float8 matmul", r"f8|fp8|e4m3|e5m2|scaled_mm"),
    ("matmul", r"gemm|cutlass|nvjet|sm90_xmma|cublas|matmul|_mm_"),
    ("attention", r"flex|flash|attention|fmha|sdpa"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("collective", r"nccl"),
    ("copy", r"memcpy|memset|copy_kernel|cat_|catarraybatched"),
    ("reduction", r"reduce|softmax|norm|sum_|amax|max_"),
    ("fused (triton)", r"triton"),
    ("elementwise", r"elementwise|vectorized|unrolled|index|gather|scatter"),
)


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def category(name: str) -> str:
    lower = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, lower):
            return label
    return "other"


def gemm_flops(op: dict) -> float | None:
    """``2 M K N`` (times the batch for bmm) of a GEMM host op from its input shapes, else None."""
    name = op.get("name", "")
    dims = op.get("args", {}).get("Input Dims")
    if not isinstance(dims, list):
        return None
    if name == "aten::addmm" and len(dims) >= 3:
        dims = dims[1:]
    if name in ("aten::mm", "aten::addmm", "aten::_scaled_mm") and len(dims) >= 2:
        a, b = dims[0], dims[1]
        if len(a) == 2 and len(b) == 2 and a[1] == b[0]:
            return 2.0 * a[0] * a[1] * b[1]
    if name == "aten::bmm" and len(dims) >= 2:
        a, b = dims[0], dims[1]
        if len(a) == 3 and len(b) == 3 and a[0] == b[0] and a[2] == b[1]:
            return 2.0 * a[0] * a[1] * a[2] * b[2]
    return None


def summarize(trace: dict, top: int, peak_tflops: float = 0.0) -> str:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep")]
    lines = []
    if not kernels:
        return "no GPU kernels in this trace (a CPU run?)"
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    wall = sum(e["dur"] for e in steps) if steps else end - start
    lines.append(f"profiled steps: {len(steps)}, wall {wall / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms "
                 f"({100 * busy / max(wall, 1):.1f}%), kernels {len(kernels)}")
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        by_cat[category(e["name"])] += e["dur"]
        by_name[e["name"]][0] += e["dur"]
        by_name[e["name"]][1] += 1
    total = sum(by_cat.values())
    lines.append("\nGPU time by category (sum of kernel durations):")
    for label, dur in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {label:16s} {dur / 1e3:9.1f} ms  {100 * dur / total:5.1f}%")
    lines.append(f"\ntop {top} kernels:")
    for name, (dur, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {dur / 1e3:8.1f} ms {n:5d}x  [{category(name)}] {name[:110]}")
    launched = _launching_ops(events)
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    op_flops: dict[str, float] = defaultdict(float)  # summed per launch of the op, not per kernel
    for e in kernels:
        op = launched.get(e.get("args", {}).get("correlation"))
        key = "(no host op)" if op is None else _op_label(op)
        by_op[key][0] += e["dur"]
        by_op[key][1] += 1
    for op in {id(op): op for op in launched.values()}.values():
        flops = gemm_flops(op)
        if flops is not None:
            op_flops[_op_label(op)] += flops
    rate = {k: op_flops[k] / (dur * 1e-6) / 1e12 for k, (dur, _) in by_op.items() if op_flops.get(k) and dur > 0}
    lines.append(f"\ntop {top} launching host ops (innermost op around the launch; kernels, GPU time):")
    for key, (dur, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]:
        implied = f"  [{rate[key]:.0f} TFLOP/s]" if key in rate else ""
        lines.append(f"  {dur / 1e3:8.1f} ms {n:5d}x  {key[:150]}{implied}")
    # float8 GEMMs (``_scaled_mm``) have twice the dense bf16 peak on Hopper
    over = sorted(k for k, r in rate.items()
                  if peak_tflops and r > peak_tflops * (2 if k.startswith("aten::_scaled_mm") else 1))
    if over:
        lines.append(f"\nWARNING: {len(over)} GEMM op(s) imply more than the peak {peak_tflops:.0f} TFLOP/s "
                     f"(e.g. {over[0][:80]}: {rate[over[0]]:.0f}): kernel records are missing or their "
                     "durations are off; read the shares, not the ms")
    lines.extend(_regions(events, kernels))
    lines.extend(_idle_gaps(events, kernels, steps, top))
    syncs: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_caller: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") == "cuda_runtime" and ("Synchronize" in name or "Memcpy" in name):
            syncs[name][0] += 1
            syncs[name][1] += e["dur"]
            op = launched.get(e.get("args", {}).get("correlation"))
            caller = by_caller[f"{name} in {'(no host op)' if op is None else _op_label(op)}"]
            caller[0] += 1
            caller[1] += e["dur"]
    lines.append("\nhost runtime calls that can block (count, host time in them): "
                 + (", ".join(f"{k} x{n} {t / 1e3:.1f} ms" for k, (n, t) in sorted(syncs.items())) or "none"))
    # a copy from pageable memory or to the host waits for the stream: the op that issued it is
    # where the host stood still
    if by_caller:
        lines.append(f"  by the innermost host op that issued them (top {top} by host time):")
        for key, (n, t) in sorted(by_caller.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"  {t / 1e3:8.1f} ms {n:5d}x  {key[:150]}")
    return "\n".join(lines)


def _idle_gaps(events: list[dict], kernels: list[dict], steps: list[dict], top: int) -> list[str]:
    """The GPU's idle time inside the profiled steps, charged to what the host was doing: each gap
    between kernels goes to the innermost host op, on the thread that launched the kernel ending
    the gap, that spans the gap's middle."""
    if not steps:
        return []
    busy = _merged([(k["ts"], k["ts"] + k["dur"]) for k in kernels])
    first_at = {}
    for k in sorted(kernels, key=lambda k: k["ts"]):
        first_at.setdefault(k["ts"], k)
    thread_of = {e["args"]["correlation"]: (e.get("pid"), e.get("tid")) for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = defaultdict(list)
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "python_function"):
            ops[(e.get("pid"), e.get("tid"))].append(e)
    charged: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    total = 0.0
    for step in steps:
        lo, hi = step["ts"], step["ts"] + step["dur"]
        edges = [(max(lo, a[1]), min(hi, b[0]), b[0]) for a, b in zip(busy, busy[1:])]
        for a, b, nxt in edges:
            if b - a <= 0:
                continue
            total += b - a
            k = first_at.get(nxt)
            thread = thread_of.get(k.get("args", {}).get("correlation")) if k else None
            mid = (a + b) / 2
            around = [e for e in ops.get(thread, []) if e["ts"] <= mid <= e["ts"] + e["dur"]]
            name = "(no host op on the launching thread)" if not around else \
                _op_label(min(around, key=lambda e: e["dur"]))[:110]
            charged[name][0] += b - a
            charged[name][1] += 1
    if not charged:
        return []
    lines = [f"\nGPU idle inside the profiled steps: {total / 1e3:.1f} ms, by the host op under each gap "
             "(innermost, on the thread that launched the next kernel):"]
    for name, (dur, n) in sorted(charged.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {dur / 1e3:8.1f} ms {n:5d}x  {name}")
    return lines


REGION_PREFIX = "titan_draft."


def _regions(events: list[dict], kernels: list[dict]) -> list[str]:
    """Host time, GPU span and kernel time inside the span of each named region (summed over its
    occurrences: micro-batches and profiled steps)."""
    host: dict[str, float] = defaultdict(float)
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        name = str(e.get("name", ""))
        if not name.startswith(REGION_PREFIX):
            continue
        if e.get("cat") == "user_annotation":
            host[name] += e["dur"]
        elif e.get("cat") == "gpu_user_annotation":
            spans[name].append((e["ts"], e["ts"] + e["dur"]))
    if not host and not spans:
        return []
    lines = ["\nnamed regions (host time; GPU span; kernel time inside the span):"]
    for name in sorted(set(host) | set(spans), key=lambda n: -sum(b - a for a, b in spans.get(n, []))):
        span = sum(b - a for a, b in spans.get(name, []))
        busy = sum(_union([(max(k["ts"], a), min(k["ts"] + k["dur"], b)) for k in kernels
                           if k["ts"] < b and k["ts"] + k["dur"] > a]) for a, b in spans.get(name, []))
        lines.append(f"  {name[len(REGION_PREFIX):]:14s} host {host.get(name, 0.0) / 1e3:8.1f} ms   "
                     f"GPU span {span / 1e3:8.1f} ms   kernels {busy / 1e3:8.1f} ms")
    return lines


def _launching_ops(events: list[dict]) -> dict:
    """``correlation id -> the innermost cpu_op event`` whose time span, on the same thread,
    holds the runtime or driver call (kernel launch, memcpy) with that id."""
    per_thread: dict[tuple, list] = defaultdict(list)
    for e in events:
        cat = e.get("cat")
        if cat == "cpu_op":
            per_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], 0, -e["dur"], e))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):  # driver: Triton
            per_thread[(e.get("pid"), e.get("tid"))].append((e["ts"], 1, 0, e))
    out = {}
    for items in per_thread.values():
        items.sort(key=lambda x: x[:3])  # at one timestamp: ops before calls, outer ops first
        stack: list[dict] = []
        for ts, kind, _, e in items:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts:
                stack.pop()
            if kind == 0:
                stack.append(e)
            elif stack:
                out[e["args"]["correlation"]] = stack[-1]
    return out


def _op_label(op: dict) -> str:
    dims = op.get("args", {}).get("Input Dims")
    shapes = [d for d in dims if d] if isinstance(dims, list) else []
    return f"{op['name']} {shapes}" if shapes else op["name"]


def _merged(intervals: list[tuple[float, float]]) -> list[list[float]]:
    """The intervals' union as disjoint ``[start, end]`` pieces, in order."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in _merged(intervals))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a .json or .json.gz chrome trace written by torch.profiler")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="the device's dense bf16 GEMM peak (H200: 989); warn when an op's implied rate is above it "
                        "(twice it for float8 _scaled_mm)")
    args = p.parse_args(argv)
    print(summarize(_load(args.trace), args.top, args.peak_tflops))


if __name__ == "__main__":
    main()
