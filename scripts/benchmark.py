#!/usr/bin/env python3
"""Benchmark the real training step: DFlash / DFlash2 / EAGLE-3 / DSpark drafts at the Qwen3-8B shape.

Each case (draft x data mode x accumulation x target x variant) builds a real ``Trainer`` from a
job config (override list) and runs ``Trainer.train()`` for ``--warmup + --steps`` optimizer
steps, in a fresh subprocess, so that peak memory and compile counters are its own. The data come
from the in-memory synthetic source (``data.source = "synthetic:<mode>"``) through the job's
torchdata pipeline; the features from a synthetic target (``target.flavor =
"synthetic:qwen3_8b"``: random captured features, no forward) or, for the online rows, from a
random-weight Qwen3-8B-shaped target (``--targets online``) or Qwen3-30B-A3B-shaped MoE target
(``--targets online_moe``). See docs/performance.md.

    python scripts/benchmark.py --out outputs/bench                      # the default matrix (24 cases)
    python scripts/benchmark.py --drafts dflash --modes varmask --variants float8 --profile float8
    torchrun --nproc_per_node 4 scripts/benchmark.py --variants float8  # every rank, fresh ranks per case
    python scripts/benchmark.py --tiny --variants eager,static           # debug shapes, CPU is fine
    python scripts/benchmark.py --drafts eagle3 --modes varmask --variants compile,float8 --targets synthetic
    python scripts/benchmark.py --drafts dspark --modes varmask --targets synthetic   # issue 12's rows
    python scripts/benchmark.py --report-only --out outputs/bench        # rebuild results.md

Each case writes ``<out>/<case>.json``; ``<out>/results.md`` is rebuilt after every case from all
case JSONs under ``<out>`` (subfolders included), so split runs merge into one table. Arguments
after ``--`` are job-config overrides added to every case (e.g. ``-- --model.args.num_anchors 256``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # runnable from a checkout without an install
    sys.path.insert(0, REPO)

from scripts.benchmark_report import SCHEMA, write_report  # noqa: E402
from scripts.benchmark_worker import CASE_FIELDS, write_json  # noqa: E402

DRAFTS = {  # name -> (ModelSpec, production flavor, debug flavor)
    "dflash": ("dflash2", "dflash_qwen3_8b", "dflash_debugmodel"),
    "dflash2": ("dflash2", "qwen3_8b", "debugmodel"),
    # issue 11's shape: TTT 7, 32000-token draft vocabulary (at the default batch 2 x 2048)
    "eagle3": ("eagle3", "qwen3_8b", "debugmodel"),
    # issue 12's shape: 5 layers, blocks of 7, 512 anchors (at the default batch 2 x 2048)
    "dspark": ("dspark", "qwen3_8b", "debugmodel"),
}
DEFAULT_DRAFTS = ("dflash", "dflash2")  # the default matrix; EAGLE-3's and DSpark's rows with --drafts
TARGETS = {  # name -> target.flavor at (production, tiny) shape, target.family
    "synthetic": ("synthetic:qwen3_8b", "synthetic:debugmodel", "qwen3"),
    "online": ("qwen3_8b", "debugmodel", "qwen3"),
    # a random-weight Qwen3-30B-A3B-shaped mixture-of-experts target (128 experts, top 8)
    "online_moe": ("qwen3_30b_a3b", "debugmodel", "qwen3_moe"),
    # the same MoE-width draft on random features: online_moe minus this row is the MoE target's share
    "synthetic_moe": ("synthetic:qwen3_30b_a3b", "synthetic:debugmodel", "qwen3_moe"),
}
# A draft works at its target's width: the production draft flavors are Qwen3-8B's (hidden 4096),
# so a target of another width gives them its attention and MLP shape (every draft's args have
# these names). Qwen3-30B-A3B: hidden 2048, 32 query / 4 key-value heads of 128, dense MLP 6144.
_MOE_WIDTH = {"hidden_size": 2048, "intermediate_size": 6144, "num_key_value_heads": 4}
TARGET_DRAFT_ARGS = {"online_moe": _MOE_WIDTH, "synthetic_moe": _MOE_WIDTH}
# synthetic rows (fixed: every position real; varmask: a 20-80 % prompt; varlen: lengths from
# max_length / 8 up; first_exchange / conversation: the recorded lengths of ShareGPT's first
# exchanges / whole conversations, scripts/length_histogram.py), "sharegpt" (the packaged ShareGPT conversations, real lengths), or a path to a
# chat file (.jsonl/.json, e.g. scripts/regenerate_data.py's output), named by its file name
MODES = ("fixed", "varmask", "varlen", "first_exchange", "conversation", "sharegpt")
# Each variant adds to the one before it, in this order.
VARIANTS = {
    "eager": [],  # pad-to-longest, blocks uncompiled (flex_attention itself is always compiled on GPU)
    "static": ["--training.static_shapes", "true"],
    "compile": ["--training.static_shapes", "true", "--compile.enable", "true"],
    "float8": ["--training.static_shapes", "true", "--compile.enable", "true", "--float8.enable", "true"],
    "float8_ac": ["--training.static_shapes", "true", "--compile.enable", "true", "--float8.enable", "true",
                  "--activation_checkpoint.mode", "full"],
    # float8 with whole conversations packed into each row (data.packing)
    "packed": ["--training.static_shapes", "true", "--compile.enable", "true", "--float8.enable", "true",
               "--data.packing", "true"],
}


def data_source(mode: str) -> str:
    """``data.source`` of a ``--modes`` entry."""
    return mode if mode == "sharegpt" or os.path.sep in mode or "." in mode else f"synthetic:{mode}"


@dataclass(frozen=True)
class Case:
    draft: str
    mode: str
    accum: int
    target: str
    variant: str
    tiny: bool = False

    @property
    def name(self) -> str:
        prefix = "tiny-" if self.tiny else ""
        mode = os.path.splitext(os.path.basename(self.mode))[0]
        return f"{prefix}{self.draft}-{mode}-acc{self.accum}-{self.target}-{self.variant}"

    def overrides(self, batch: int, seq: int, total_steps: int, dump_folder: str) -> list[str]:
        """The job config of this case, as CLI overrides on the built-in defaults."""
        shape = 1 if self.tiny else 0
        return [
            "--job.dump_folder", dump_folder,
            "--model.name", DRAFTS[self.draft][0],
            "--model.flavor", DRAFTS[self.draft][1 + shape],
            "--target.flavor", TARGETS[self.target][shape],
            "--target.family", TARGETS[self.target][2],
            *self.draft_args(),
            "--data.source", data_source(self.mode),
            "--data.max_length", str(seq),
            "--training.local_batch_size", str(batch),
            "--training.grad_accum_steps", str(self.accum),
            "--training.steps", str(total_steps),
            "--checkpoint.enable", "false",
            "--checkpoint.export", "false",
            "--metrics.enable_tensorboard", "false",
            "--metrics.log_freq", str(total_steps),
            *VARIANTS[self.variant],
        ]


    def draft_args(self) -> list[str]:
        """``model.args`` overrides that fit the production draft flavor to the target's width."""
        if self.tiny:  # the debug flavors all share one width
            return []
        return [a for k, v in TARGET_DRAFT_ARGS.get(self.target, {}).items() for a in (f"--model.args.{k}", str(v))]


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def build_cases(args) -> list[Case]:
    """The run's cases, per draft: the variant ladder (every ``--variants``) in every mode at the
    first ``--accum`` value on the first target; then the side rows (the other accum values, then
    the other targets) in the first mode only, with the ``--side-variants`` among ``--variants``
    (the ladder's ends by default, so the whole matrix fits one GPU session)."""
    side = [v for v in args.variants if "all" in args.side_variants or v in args.side_variants]
    accum0, target0, mode0 = args.accum[0], args.targets[0], args.modes[0]
    cases = []
    for draft in args.drafts:
        for mode in args.modes:
            cases += [Case(draft, mode, accum0, target0, v, args.tiny) for v in args.variants]
        for accum in args.accum[1:]:
            cases += [Case(draft, mode0, accum, target0, v, args.tiny) for v in side]
        for target in args.targets[1:]:
            cases += [Case(draft, mode0, accum0, target, v, args.tiny) for v in side]
    return cases


# ---------------------------------------------------------------------------------------------
# Parent: one subprocess per case.


def _torchrun_rank() -> int | None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def _child_env(case_index: int, cache_dir: str | None) -> dict:
    env = dict(os.environ)
    # run_train.sh's allocator setting, so the memory figures are those of a job
    env.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    if cache_dir:
        # a cold compile: no Inductor/Triton artifacts of earlier cases (or runs) are reused
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, "inductor")
        env["TRITON_CACHE_DIR"] = os.path.join(cache_dir, "triton")
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if _torchrun_rank() is not None:
        # Under torchrun each rank's child joins a fresh group: its own TCP store (hosted by rank
        # 0's child) on a port of its own per case, instead of the agent's store of this launch.
        env["MASTER_PORT"] = str(int(env["MASTER_PORT"]) + 1 + case_index)
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    return env


def run_case(case: Case, index: int, args, command: str, timeout: float) -> dict | None:
    """Run one case in a subprocess; returns a failure record (None when the worker wrote its own)."""
    profile = case.variant in args.profile or "all" in args.profile
    # profiled cases add two untimed steps at the end: the profiler's warm-up and the recorded one
    total = args.warmup + args.steps + (2 if profile else 0)
    dump = tempfile.mkdtemp(prefix="titan_draft_bench_")
    overrides = case.overrides(args.batch, args.seq, total, dump) + args.extra
    if profile:
        overrides += ["--profiling.enable_profiling", "true", "--profiling.profile_freq", str(total),
                      "--profiling.profile_warmup", "1", "--profiling.profile_active", "1",
                      "--profiling.save_traces_folder", "traces"]
    spec = {
        "name": case.name, "case": asdict(case), "overrides": overrides, "warmup": args.warmup,
        "steps": args.steps, "batch": args.batch, "seq": args.seq, "profile": profile, "out": args.out,
        "fresh_compile_cache": args.fresh_compile_cache, "command": command, "extra_overrides": list(args.extra),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    rank = _torchrun_rank()
    log_dir = os.path.join(args.out, "logs")
    os.makedirs(log_dir, exist_ok=True)
    log_path = os.path.join(log_dir, f"{case.name}{'' if not rank else f'.rank{rank}'}.log")
    cmd = [sys.executable, "-m", "scripts.benchmark_worker", json.dumps(spec)]
    cache_dir = tempfile.mkdtemp(prefix="titan_draft_bench_cache_") if args.fresh_compile_cache else None
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        # its own session, so a timeout also ends the compile workers it started
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(index, cache_dir),
                                 cwd=REPO, start_new_session=True)
        try:
            rc = child.wait(timeout=timeout)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            status = f"timeout ({timeout:.0f} s)"
    wall = time.perf_counter() - t0
    for folder in (dump, cache_dir):
        if folder:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"[benchmark] {case.name}: {status} in {wall:.0f} s (log {log_path})", flush=True)
    if status == "ok" or rank:
        return None
    with open(log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    return {"schema": SCHEMA, "status": status, **{key: spec[key] for key in CASE_FIELDS}, "wall_s": wall,
            "error_tail": tail}


def run_cases(args, argv: list[str]) -> None:
    cases = build_cases(args)
    command = " ".join(shlex.quote(a) for a in ["python", "scripts/benchmark.py", *argv])
    if _torchrun_rank() is not None:
        command = f"torchrun --nproc_per_node {os.environ['WORLD_SIZE']} {command[len('python '):]}"
    os.makedirs(args.out, exist_ok=True)
    is_main = not _torchrun_rank()
    start = time.perf_counter()
    for index, case in enumerate(cases):
        path = os.path.join(args.out, f"{case.name}.json")
        if args.skip_done and _status(path) == "ok":
            print(f"[benchmark] {case.name}: done before, skipped", flush=True)
            continue
        timeout = args.timeout
        if args.budget_s:
            left = args.budget_s - (time.perf_counter() - start)
            if left < args.min_case_s:
                print(f"[benchmark] budget spent: {case.name} and later cases not run", flush=True)
                break
            timeout = min(timeout, left)
        failure = run_case(case, index, args, command, timeout)
        if is_main:
            if failure is not None:
                write_json(path, failure)
            write_report(args.out)


def _status(path: str) -> str | None:
    try:
        with open(path) as f:
            return json.load(f).get("status")
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafts", type=_csv, default=list(DEFAULT_DRAFTS),
                   help=f"comma list of {list(DRAFTS)} (default: {','.join(DEFAULT_DRAFTS)})")
    p.add_argument("--modes", type=_csv, default=["varmask", "fixed"], help=f"comma list of {list(MODES)}")
    p.add_argument("--variants", type=_csv, default=["eager", "static", "compile", "float8"],
                   help=f"comma list of {list(VARIANTS)}, each adding to the one before")
    p.add_argument("--accum", type=lambda s: [int(v) for v in _csv(s)], default=[1, 4],
                   help="comma list of training.grad_accum_steps values")
    p.add_argument("--targets", type=_csv, default=["synthetic", "online"],
                   help="comma list of synthetic (random features, no target forward), online "
                        "(random-weight Qwen3-8B-shaped target), online_moe (random-weight "
                        "Qwen3-30B-A3B-shaped MoE target) and synthetic_moe (random features at that "
                        "target's width: the MoE target's share is online_moe minus it); the first "
                        "one gets the full ladder")
    p.add_argument("--side-variants", type=_csv, default=None,
                   help="variants run for the side rows (accum values after the first, targets after "
                        "the first; first mode only), or 'all' (default: eager and float8 where run)")
    p.add_argument("--tiny", action="store_true", help="debug flavors (CPU is fine) instead of Qwen3-8B shapes")
    p.add_argument("--batch", type=int, default=2, help="training.local_batch_size")
    p.add_argument("--seq", type=int, default=None, help="data.max_length (default 2048; 64 with --tiny)")
    p.add_argument("--warmup", type=int, default=3, help="steps before the timed window")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--out", default="outputs/benchmark", help="folder of the case JSONs, logs and results.md")
    p.add_argument("--timeout", type=float, default=420, help="seconds per case before it is killed")
    p.add_argument("--budget-s", type=float, default=0,
                   help="stop starting cases after this many seconds (0: no limit); with --skip-done "
                        "the same command continues later")
    p.add_argument("--min-case-s", type=float, default=60, help="with --budget-s: least time a case is started with")
    p.add_argument("--fresh-compile-cache", action="store_true",
                   help="give every case an empty Inductor/Triton cache (cold compile warm-up figures); "
                        "by default later cases reuse the kernels earlier ones compiled")
    p.add_argument("--skip-done", action="store_true", help="skip cases whose JSON under --out is ok")
    p.add_argument("--profile", type=_csv, default=[],
                   help="comma list of variants (or 'all') whose cases also record a torch.profiler trace of "
                        "one extra, untimed step into <out>/traces/ (the job's own profiler)")
    p.add_argument("--report-only", action="store_true", help="only rebuild <out>/results.md")
    args = p.parse_args(argv)
    args.extra = extra
    args.out = os.path.abspath(args.out)
    if args.seq is None:
        args.seq = 64 if args.tiny else 2048
    if args.side_variants is None:
        args.side_variants = [v for v in ("eager", "float8") if v in args.variants]
    modes = [m for m in args.modes if data_source(m).startswith("synthetic:") or m == "sharegpt"]
    for name, values, known in (("--drafts", args.drafts, DRAFTS), ("--modes", modes, MODES),
                                ("--variants", args.variants, VARIANTS), ("--targets", args.targets, TARGETS),
                                ("--side-variants", [v for v in args.side_variants if v != "all"], VARIANTS),
                                ("--profile", [v for v in args.profile if v != "all"], VARIANTS)):
        bad = [v for v in values if v not in known]
        if bad:
            p.error(f"{name}: unknown {bad}; choose from {list(known)}")
    outside = [v for v in args.side_variants if v != "all" and v not in args.variants]
    if outside:
        p.error(f"--side-variants: {outside} not among --variants {args.variants}")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.report_only:
        print(write_report(args.out))
        return
    run_cases(args, argv)
    if not _torchrun_rank():
        print(f"[benchmark] table: {os.path.join(args.out, 'results.md')}")


if __name__ == "__main__":
    main()
