#!/usr/bin/env python3
"""Benchmark offline mode (issue 13): the training step on cached features read from the local
disk, beside the synthetic-features row and the online row of the same draft, the disk's own read
bandwidth measured in the same run, and prepare_features' capture throughput.

Cases (each in a fresh subprocess, ``<out>/<case>.json``; ``<out>/offline_results.md`` at the end):

- ``write``: a cache for the job (synthetic rows, random features in the storage dtype) written to
  ``<out>/cache`` through the prepare script's own shard writer, evicted from the page cache; then
  the disk's sequential read bandwidth over those files (cold: evicted before and after);
- ``offline``: the step with ``data.feature_cache = <out>/cache`` (shards evicted first, so the
  loader reads the disk, not memory);
- ``synthetic``: the step with random features made on the device (``target.flavor =
  synthetic:<flavor>``), the row offline mode is held to (within 5 %, data wait < 2 %);
- ``online``: the step with the random-weight target running (its cost per token is the yardstick
  of prepare_features);
- ``prepare``: scripts/prepare_features.py on the random-weight target (forward tokens/s, writing
  overlapped).

    python scripts/bench_offline.py --out /local_nvme/bench_offline             # H200, DFlash2 qwen3_8b, 2 x 2048
    python scripts/bench_offline.py --out /tmp/bo --tiny --cases write,offline,synthetic   # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

CASES = ("write", "offline", "synthetic", "online", "prepare")
VARIANT = ["--training.static_shapes", "true", "--compile.enable", "true", "--float8.enable", "true"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results and the cache (put it on the disk to measure)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {CASES}")
    p.add_argument("--draft", default="dflash2")
    p.add_argument("--flavor", default=None, help="draft flavor (qwen3_8b; debugmodel with --tiny)")
    p.add_argument("--target-flavor", default=None, help="random target flavor (qwen3_8b; debugmodel with --tiny)")
    p.add_argument("--mode", default="varmask", help="synthetic data mode")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=None, help="tokens per row (2048; 64 with --tiny)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--storage", default="bfloat16")
    p.add_argument("--prepare-rows", type=int, default=64, help="rows the prepare case captures")
    p.add_argument("--writers", type=int, default=4, help="prepare_features --writers (shards written at once)")
    p.add_argument("--tiny", action="store_true", help="debug shapes, eager (CPU is fine)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a, extra = p.parse_known_args(argv)
    a.flavor = a.flavor or ("debugmodel" if a.tiny else "qwen3_8b")
    a.target_flavor = a.target_flavor or ("debugmodel" if a.tiny else "qwen3_8b")
    a.seq = a.seq or (64 if a.tiny else 2048)
    a.extra = [x for x in extra if x != "--"]
    return a


def job_overrides(a, case: str) -> list[str]:
    rows = a.batch * (a.warmup + a.steps)  # one pass: every step reads rows it has not read before
    target = a.target_flavor if case in ("online", "prepare") else f"synthetic:{a.target_flavor}"
    o = ["--model.name", a.draft, "--model.flavor", a.flavor, "--target.path", "", "--target.flavor", target,
         "--data.source", f"synthetic:{a.mode}", "--data.max_length", str(a.seq), "--data.max_rows",
         str(a.prepare_rows if case == "prepare" else rows), "--training.local_batch_size", str(a.batch),
         "--training.steps", str(a.warmup + a.steps), "--job.dump_folder", os.path.join(a.out, f"dump_{case}"),
         "--checkpoint.enable", "false", "--checkpoint.export", "false", "--metrics.enable_tensorboard", "false",
         "--metrics.log_freq", "1000000", "--eval.enable", "false", "--profiling.enable_profiling", "false"]
    o += ["--training.static_shapes", "true"] if a.tiny else VARIANT
    if case == "offline":
        o += ["--data.feature_cache", os.path.join(a.out, "cache"), "--data.feature_cache_verify", "false"]
    return o + a.extra


def evict(paths: list[str]) -> None:
    """Drop the files' pages from the page cache (no root needed: they are clean after fsync)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def shard_paths(folder: str) -> list[str]:
    with open(os.path.join(folder, "manifest.json")) as f:
        return [os.path.join(folder, s["file"]) for s in json.load(f)["shards"]]


def read_bandwidth(paths: list[str], block: int = 64 << 20) -> dict:
    """Cold sequential read of every file in ``block`` reads: the disk's own bandwidth."""
    evict(paths)
    buf = bytearray(block)
    total, t0 = 0, time.perf_counter()
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    secs = time.perf_counter() - t0
    evict(paths)
    return {"bytes": total, "seconds": secs, "gb_per_s": total / secs / 1e9}


def write_bandwidth(folder: str, total: int = 2 << 30, block: int = 64 << 20) -> dict:
    """The disk's own sequential write rate: ``total`` bytes in ``block`` writes, fsynced, what a
    prepare rank's shard writing is bounded by."""
    path = os.path.join(folder, "write_bandwidth.tmp")
    buf = os.urandom(block)
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(total // block):
            f.write(buf)
        os.fsync(f.fileno())
    secs = time.perf_counter() - t0
    os.remove(path)
    return {"bytes": total, "seconds": secs, "gb_per_s": total / secs / 1e9}


def run_write(a) -> dict:
    import torch

    from titan_draft.features.synthetic import build_synthetic_target
    from titan_draft.features.target import build_target_tokenizer
    from titan_draft.config import ConfigManager
    from titan_draft.data.chat.format import build_chat_format
    from titan_draft.data.features.manifest import MANIFEST, job_facts, write_json_atomic
    from titan_draft.data.features.shards import FORMAT, row_features, to_storage
    from titan_draft.data.features.writer import ShardWriter
    from titan_draft.data.sources.synthetic import build_synthetic_source
    from titan_draft.protocols import get_model_spec
    from titan_draft.components.model_args import resolve_model_args

    cfg = ConfigManager().parse_args(job_overrides(a, "offline"))
    spec = get_model_spec(cfg.model.name)
    target = build_synthetic_target(cfg, torch.device("cpu"), torch.bfloat16)
    tok = build_target_tokenizer(cfg, target.args.vocab_size)
    chat = build_chat_format(cfg.data, tok)
    args = resolve_model_args(spec, cfg, target.args, tok, chat)
    layers = sorted(set(spec.capture_layers_fn(args)))
    reserved = list(spec.reserved_tokens_fn(args)) if spec.reserved_tokens_fn else []
    need_last = spec.needs_last_hidden_for(args)
    facts = job_facts(cfg, target.args, tok, chat, layers, need_last, reserved)
    out = cfg.data.feature_cache
    os.makedirs(out, exist_ok=True)
    h = target.args.hidden_size
    g = torch.Generator().manual_seed(0)
    # a pool of random rows, rolled per row: the bytes on disk are what is measured, not their values
    pool = torch.randn(2 * a.seq, h, generator=g).to(torch.bfloat16)
    writer = ShardWriter(out, 0, storage=a.storage, shard_bytes=1 << 30, first_shard=0)
    t0 = time.perf_counter()
    rows = 0
    for k, (ids, mask) in enumerate(build_synthetic_source(cfg.data, dp_rank=0, dp_world=1,
                                                           seed=cfg.training.seed).usable_samples()):
        n = len(ids)
        aux = torch.cat([pool[(k + j) % a.seq:][:n] for j in range(len(layers))], -1)[None]
        stored = to_storage(aux, pool[None, :n] if need_last else None, len(layers), a.storage)
        writer.add(ids, mask, k, row_features(stored, 0, n, layers))
        rows += 1
    shards = writer.close()
    write_secs = time.perf_counter() - t0
    meta = {"format": FORMAT, "complete": True, "storage": a.storage, "prepare_world": 1, "target_dtype": "bfloat16",
            "draft": cfg.model.name, "facts": facts, "rows": rows, "tokens": sum(s["tokens"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards), "shards": shards}
    write_json_atomic(os.path.join(out, MANIFEST), meta)
    bw = read_bandwidth(shard_paths(out))
    return {"rows": rows, "shards": len(shards), "cache_bytes": meta["bytes"], "capture_layers": layers,
            "bytes_per_token": meta["bytes"] / max(meta["tokens"], 1), "write_s": write_secs, "disk_read": bw}


def run_step(a, case: str) -> dict:
    from scripts.benchmark_worker import StepProbe
    from titan_draft.config import ConfigManager
    from titan_draft.distributed.utils import destroy_distributed
    from titan_draft.train import Trainer

    if case == "offline":
        evict(shard_paths(os.path.join(a.out, "cache")))
    trainer = Trainer(ConfigManager().parse_args(job_overrides(a, case)))
    probe = StepProbe(trainer)
    try:
        trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    timed = probe.records[a.warmup:]
    step = statistics.median(r["step_s"] for r in timed)
    data = statistics.median(r["data_s"] for r in timed)
    tokens = statistics.mean(r["samples"] for r in timed) * a.seq
    return {"step_ms": 1e3 * step, "data_wait_ms": 1e3 * data, "data_wait_pct": 100 * data / step,
            "tokens_per_step": tokens, "records": probe.records}


def run_prepare(a) -> dict:
    from scripts.prepare_features import prepare
    from titan_draft.distributed.utils import destroy_distributed

    try:
        r = prepare(["--out", os.path.join(a.out, "prepare_cache"), "--storage", a.storage,
                     "--writers", str(a.writers), *job_overrides(a, "prepare")])
    finally:
        destroy_distributed()
    t = r["rank0_timing"]
    shutil.rmtree(os.path.join(a.out, "prepare_cache"))  # room for the write measurement
    disk_write = write_bandwidth(a.out, total=(64 << 20) if a.tiny else 2 << 30)
    return {"writers": a.writers, "disk_write": disk_write, "rows": r["rows"], "tokens": r["tokens"],
            "bytes": r["bytes"], "seconds": t["seconds"],
            "computed_tokens": t["computed_tokens"], "forward_seconds": t["forward_seconds"], "batches": t["batches"],
            "forward_median_seconds": t["forward_median_seconds"],
            "forward_us_per_token": 1e6 * t["forward_seconds"] / t["tokens"],
            # what the online row's target cost is per (tokens computed, padding included), from the
            # median batch (the first one warms the kernels up)
            "forward_us_per_computed_token": 1e6 * t["forward_median_seconds"] * t["batches"] / t["computed_tokens"],
            "total_us_per_token": 1e6 * t["seconds"] / t["tokens"]}


def worker(a) -> None:
    from titan_draft.logger import init_logger

    init_logger()
    case = a.worker
    result = run_write(a) if case == "write" else run_prepare(a) if case == "prepare" else run_step(a, case)
    with open(os.path.join(a.out, f"{case}.json"), "w") as f:
        json.dump({"case": case, **result}, f, indent=1)


def report(a) -> str:
    r = {}
    for case in CASES:
        path = os.path.join(a.out, f"{case}.json")
        if os.path.isfile(path):
            with open(path) as f:
                r[case] = json.load(f)
    lines = [f"# offline mode, {a.draft}/{a.flavor}, {a.batch} x {a.seq}, {a.storage} cache", ""]
    if "write" in r:
        w = r["write"]
        lines.append(f"- cache: {w['rows']} rows, {w['cache_bytes'] / 1e9:.2f} GB in {w['shards']} shards, "
                     f"{w['bytes_per_token'] / 1e3:.1f} KB/token (capture layers {w['capture_layers']})")
        lines.append(f"- disk read bandwidth (cold, sequential 64 MiB reads): {w['disk_read']['gb_per_s']:.2f} GB/s")
    lines += ["", "| case | step ms | data wait ms | data wait % | vs synthetic | feature GB/s needed |",
              "| --- | --- | --- | --- | --- | --- |"]
    per_tok = r["write"]["bytes_per_token"] if "write" in r else None
    for case in ("offline", "synthetic", "online"):
        if case not in r:
            continue
        c = r[case]
        vs = f"{c['step_ms'] / r['synthetic']['step_ms']:.3f}" if "synthetic" in r else "-"
        need = f"{per_tok * c['tokens_per_step'] / (c['step_ms'] / 1e3) / 1e9:.2f}" if per_tok and case == "offline" \
            else "-"
        lines.append(f"| {case} | {c['step_ms']:.1f} | {c['data_wait_ms']:.2f} | {c['data_wait_pct']:.2f} | {vs} | "
                     f"{need} |")
    if "online" in r and "synthetic" in r:
        c = r["online"]
        cost = (c["step_ms"] - r["synthetic"]["step_ms"]) / c["tokens_per_step"] * 1e3
        lines.append(f"\n- online target cost: {cost:.2f} µs/token (online step - synthetic step)")
    if "prepare" in r:
        p = r["prepare"]
        lines.append(f"- prepare: {p['rows']} rows, {p['tokens']} tokens ({p['computed_tokens']} computed with "
                     f"the padding): target forward {p['forward_us_per_token']:.2f} µs/token "
                     f"({p['forward_us_per_computed_token']:.2f} per computed token from the median batch, device time), end to end "
                     f"(copies and writing overlapped) {p['total_us_per_token']:.2f} µs/token; written "
                     f"{p['bytes'] / 1e9:.2f} GB at {p['bytes'] / p['seconds'] / 1e9:.2f} GB/s by {p['writers']} writers, "
                     f"the disk's own sequential write (fsynced 64 MiB writes) {p['disk_write']['gb_per_s']:.2f} GB/s")
        if "online" in r and "synthetic" in r:
            lines.append(f"- prepare forward per computed token / online target cost per token: "
                         f"{p['forward_us_per_computed_token'] / cost:.2f} (the goal: at most 1 / 0.8 = 1.25)")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "offline_results.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None) -> None:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    os.makedirs(a.out, exist_ok=True)
    if a.worker:
        return worker(a)
    for case in a.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"--cases: unknown case {case!r} ({CASES})")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", case, *(sys.argv[1:] if argv is None else argv)]
        with open(os.path.join(a.out, f"{case}.log"), "w") as log:
            proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        print(f"{case}: {'ok' if proc.returncode == 0 else f'FAILED (rc {proc.returncode}, see {case}.log)'}")
    print(report(a))


if __name__ == "__main__":
    main()
