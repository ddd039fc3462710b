"""The benchmark's worker: one case in its own process (each rank of it, under torchrun).

It builds the job's ``Trainer`` from the case's override list and runs ``Trainer.train()``; a
``StepProbe`` on that one instance times every optimizer step with the device synchronized around
it. Started by scripts/benchmark.py as ``python -m scripts.benchmark_worker '<spec json>'``.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import statistics
import sys
import time

from scripts.benchmark_report import SCHEMA

CASE_FIELDS = ("name", "case", "batch", "seq", "warmup", "steps", "date", "command", "extra_overrides")
"""What every case JSON, ok or failed, copies from its spec: the case and the run it belongs to
(the ``--`` overrides every case of the run got are part of what a row measures)."""


class _TimedLoader:
    """The trainer's dataloader, timing how long the loop is blocked in ``next``."""

    def __init__(self, loader, probe: "StepProbe"):
        self._loader = loader
        self._probe = probe

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        batch = next(self._loader)
        self._probe.pending_data_s += time.perf_counter() - t0
        return batch

    def __getattr__(self, name):
        return getattr(self._loader, name)


class StepProbe:
    """Times every optimizer step of ``Trainer.train`` with the device synchronized around it.

    Installed on one Trainer instance (not the class): its ``train_step`` and ``dataloader``
    become timed wrappers; what they run is unchanged.
    """

    def __init__(self, trainer):
        import torch

        self.trainer = trainer
        self.cuda = trainer.device.type == "cuda"
        self.sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        self.records: list[dict] = []
        self.pending_data_s = 0.0
        self._train_step = trainer.train_step
        trainer.train_step = self._timed_train_step
        trainer.dataloader = _TimedLoader(trainer.dataloader, self)

    def _timed_train_step(self, micro_batches):
        import torch

        from titan_draft.data.packing import packed_counts

        self.sync()
        t0 = time.perf_counter()
        out = self._train_step(micro_batches)
        self.sync()
        compute_s = time.perf_counter() - t0
        data_s, self.pending_data_s = self.pending_data_s, 0.0
        self.records.append({
            "data_s": data_s,
            "compute_s": compute_s,
            "step_s": data_s + compute_s,
            "seq_lens": [int(b["input_ids"].shape[1]) for b in micro_batches],
            # conversations (a packed row holds several) and real tokens (padding left out)
            "samples": sum(packed_counts(b)[0] for b in micro_batches),
            "tokens": sum(packed_counts(b)[1] for b in micro_batches),
            "positions": sum(int(b["input_ids"].numel()) for b in micro_batches),
            "dynamo_frames": dynamo_counter("frames", "total"),
            # read every step: the trainer's metrics logger resets the peak when it logs
            "peak_allocated": torch.cuda.max_memory_allocated() if self.cuda else None,
            "peak_reserved": torch.cuda.max_memory_reserved() if self.cuda else None,
        })
        return out


def dynamo_counter(group: str, key: str | None = None) -> int:
    """A torch._dynamo counter (a group's sum without ``key``). ``frames/total`` counts every
    frame dynamo had to (re)compile: after warm-up each increment is a recompile or a new graph."""
    from torch._dynamo.utils import counters

    values = counters.get(group, {})
    return int(values.get(key, 0) if key else sum(values.values()))


def summarize(records: list[dict], warmup: int, steps: int, *, world: int, flops_per_step: float,
              peak_flops: float | None) -> dict:
    """Figures of the steady window (records ``warmup .. warmup + steps``) of one case."""
    warm, steady = records[:warmup], records[warmup:warmup + steps]
    if not steady:
        raise RuntimeError(f"only {len(records)} steps recorded; need more than --warmup {warmup}")
    step_s = [r["step_s"] for r in steady]
    median = statistics.median(step_s)
    data_s = [r["data_s"] for r in steady]
    samples = statistics.mean(r["samples"] for r in steady) * world
    tokens = statistics.mean(r["tokens"] for r in steady) * world
    positions = statistics.mean(r.get("positions", r["tokens"]) for r in steady) * world
    achieved = flops_per_step / median
    gib = 1024**3

    def peak(key: str, rows: list[dict]) -> float | None:
        values = [r[key] for r in rows if r[key] is not None]
        return max(values) / gib if values else None  # None on CPU: no allocator statistics

    return {
        "step_ms_median": 1e3 * median,
        "step_ms_mean": 1e3 * statistics.mean(step_s),
        "step_ms_min": 1e3 * min(step_s),
        "step_ms_max": 1e3 * max(step_s),
        "compute_ms_median": 1e3 * statistics.median(r["compute_s"] for r in steady),
        "data_wait_ms_median": 1e3 * statistics.median(data_s),
        "data_wait_ms_mean": 1e3 * statistics.mean(data_s),
        "data_wait_pct": 100.0 * statistics.mean(data_s) / statistics.mean(step_s),
        "samples_per_s": samples / median,
        "samples_per_s_per_gpu": samples / median / world,
        "tokens_per_s": tokens / median,
        "padding_pct": 100.0 * (1.0 - tokens / positions),
        "model_tflop_per_step": flops_per_step / 1e12,
        "achieved_tflops": achieved / 1e12,
        "mfu_pct": 100.0 * achieved / peak_flops if peak_flops else None,
        "first_step_s": records[0]["step_s"],
        "warmup_total_s": sum(r["step_s"] for r in warm),
        # the time the warm-up steps took beyond steady steps: compile, autotuning, first allocations
        "compile_warmup_s": sum(r["step_s"] for r in warm) - len(warm) * median,
        "recompiles_after_warmup": steady[-1]["dynamo_frames"] - (warm[-1]["dynamo_frames"] if warm else 0),
        "dynamo_frames_warmup": warm[-1]["dynamo_frames"] if warm else 0,
        "peak_allocated_gib": peak("peak_allocated", records),
        "peak_reserved_gib": peak("peak_reserved", records),
        "steady_peak_allocated_gib": peak("peak_allocated", steady),
        "step_ms": [1e3 * r["step_s"] for r in records],
        "seq_lens_steady": sorted({s for r in steady for s in r["seq_lens"]}),
    }


def model_flops_per_step(trainer, records: list[dict]) -> float:
    """Model FLOPs of one optimizer step on this rank, from the ModelSpec's counter (no
    recompute), averaged over the padded lengths the steady steps actually had."""
    flops_fn = trainer.spec.flops_fn
    if flops_fn is None:
        return 0.0
    batch = trainer.cfg.training.local_batch_size
    per_step = [sum(flops_fn(trainer.model_args, batch, s) for s in r["seq_lens"]) for r in records]
    return statistics.mean(per_step)


def _copy_trace(dump_folder: str, out: str, name: str) -> str | None:
    """Newest rank-0 profiler trace of the run, gzipped (Perfetto and TensorBoard read .json.gz)."""
    root = os.path.join(dump_folder, "traces")
    found = []
    for folder, _, files in os.walk(root):
        found += [os.path.join(folder, f) for f in files if f.startswith("rank0_") and f.endswith(".json")]
    if not found:
        return None
    src = max(found, key=os.path.getmtime)
    os.makedirs(os.path.join(out, "traces"), exist_ok=True)
    dst = os.path.join(out, "traces", f"{name}.pt.trace.json.gz")
    with open(src, "rb") as fin, gzip.open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout)
    return os.path.relpath(dst, out)


def run_worker(spec: dict) -> None:
    """Build the Trainer of ``spec["overrides"]``, train, and write ``<out>/<name>.json`` (rank 0)."""
    import torch

    from titan_draft.components.metrics import get_peak_flops
    from titan_draft.features.target import check_target_config
    from titan_draft.config import ConfigManager, validate_job_config
    from titan_draft.distributed.utils import destroy_distributed
    from titan_draft.logger import init_logger, logger
    from titan_draft.train import Trainer

    init_logger()
    warmup, steps, profile = spec["warmup"], spec["steps"], spec["profile"]
    argv = list(spec["overrides"])
    cfg = ConfigManager().parse_args(argv)
    validate_job_config(cfg, logger)
    check_target_config(cfg)

    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    build_s = time.perf_counter() - t0
    probe = StepProbe(trainer)
    if probe.cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        losses = trainer.train()
    finally:
        trainer.close()
    world = trainer.dp_world
    peak_flops = get_peak_flops(torch.cuda.get_device_name()) if probe.cuda else None
    steady = probe.records[warmup:warmup + steps]
    flops = model_flops_per_step(trainer, steady)
    result = {
        "schema": SCHEMA,
        "status": "ok",
        **{key: spec[key] for key in CASE_FIELDS},
        "world_size": world,
        "overrides": argv,
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if probe.cuda else "cpu",
        "peak_flops": peak_flops,
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF", ""),
        "compile_cache": "fresh" if spec["fresh_compile_cache"] else "shared",
        "build_s": build_s,
        "profiled": profile,
        "final_loss": losses[max(losses)] if losses else None,
        "graph_breaks": dynamo_counter("graph_break"),
        "graphs_compiled": dynamo_counter("stats", "unique_graphs"),
        "run_info": trainer.run_info,
        # the draft's resolved args (flavor + overrides + what the trainer set): what was measured
        "model_args": dataclasses.asdict(trainer.model_args),
        **summarize(probe.records, warmup, steps, world=world, flops_per_step=flops, peak_flops=peak_flops),
    }
    if trainer.dist.rank == 0:
        if profile:
            result["trace"] = _copy_trace(cfg.job.dump_folder, spec["out"], spec["name"])
        write_json(os.path.join(spec["out"], f"{spec['name']}.json"), result)
        logger.info("benchmark %s: %.1f ms/step, %.2f samples/s", spec["name"],
                    result["step_ms_median"], result["samples_per_s"])
    destroy_distributed()


def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)  # a reader never sees half a file


if __name__ == "__main__":
    run_worker(json.loads(sys.argv[1]))
