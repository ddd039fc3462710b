"""The benchmark (scripts/benchmark.py); its synthetic source and target are tested in
tests/unit/features/test_synthetic.py.

The end-to-end test runs the benchmark's tiny flavor on CPU through real Trainers, so a change
that breaks the benchmark (or the job path it measures) fails here, not on the GPU machine.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from titan_draft.config import ConfigManager
from helpers import REPO

SCRIPT = os.path.join(REPO, "scripts", "benchmark.py")


def _load_benchmark_module():
    """scripts/benchmark.py as a module (scripts/ is not an installed package)."""
    spec = importlib.util.spec_from_file_location("titan_draft_benchmark_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


# ---- the benchmark, end to end (tiny flavor, CPU) ----


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # compile with aot_eager: the compile path and its counters, without a C++ build on CPU
    cmd = [sys.executable, SCRIPT, "--tiny", "--drafts", "dflash2", "--modes", "varmask", "--accum", "2",
           "--variants", "eager,static,compile", "--warmup", "1", "--steps", "2", "--out", str(out),
           "--", "--compile.backend", "aot_eager"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, proc.stdout


@pytest.mark.slow
def test_benchmark_tiny_writes_sane_results(tiny_run):
    out, stdout = tiny_run
    names = [f"tiny-dflash2-varmask-acc2-synthetic-{v}" for v in ("eager", "static", "compile")]
    for name in names:
        path = out / f"{name}.json"
        assert path.is_file(), stdout + "".join(p.read_text()[-2000:] for p in (out / "logs").iterdir())
        r = json.loads(path.read_text())
        assert r["status"] == "ok" and r["name"] == name
        assert r["world_size"] == 1 and r["batch"] == 2 and r["seq"] == 64
        assert r["torch"] == torch.__version__ and r["device_name"] == "cpu"
        assert r["date"] and "scripts/benchmark.py" in r["command"]
        assert len(r["step_ms"]) == r["warmup"] + r["steps"] == 3
        assert r["step_ms_median"] > 0
        assert r["step_ms_min"] <= r["step_ms_median"] <= r["step_ms_max"]
        # 2 samples x 2 micro-batches per step; every varmask sample is 64 tokens long
        assert r["samples_per_s"] == pytest.approx(4 / (r["step_ms_median"] / 1e3), rel=1e-6)
        assert r["tokens_per_s"] == pytest.approx(64 * r["samples_per_s"], rel=1e-6)
        assert r["model_tflop_per_step"] > 0
        assert r["achieved_tflops"] == pytest.approx(r["model_tflop_per_step"] / (r["step_ms_median"] / 1e3))
        assert r["mfu_pct"] is None and r["peak_allocated_gib"] is None  # no GPU peak on CPU
        assert 0 <= r["data_wait_pct"] < 100 and r["data_wait_ms_mean"] >= 0
        assert isinstance(r["recompiles_after_warmup"], int) and r["recompiles_after_warmup"] == 0
        assert isinstance(r["compile_warmup_s"], float)
        assert math.isfinite(r["final_loss"])
        assert r["run_info"]["draft"] == "dflash2/debugmodel"
        assert r["run_info"]["target"] == "synthetic:debugmodel"
        # the resolved draft args: static shapes set the anchor slots, the flavor's top-K default
        assert r["model_args"]["static_anchors"] == (not name.endswith("eager"))
        assert r["model_args"]["selector_enabled"] and r["model_args"]["selector_topk_group"] == 128
    # the default targets add the online side row (a random debug target computing the features)
    online = json.loads((out / "tiny-dflash2-varmask-acc2-online-eager.json").read_text())
    assert online["status"] == "ok" and online["run_info"]["target"] == "random:debugmodel"
    assert math.isfinite(online["final_loss"]) and online["step_ms_median"] > 0
    runs = {n: json.loads((out / f"{n}.json").read_text())["run_info"] for n in names}
    assert not runs[names[0]]["static_shapes"] and runs[names[1]]["static_shapes"]
    assert runs[names[2]]["compile"] and not runs[names[1]]["compile"]
    compiled = json.loads((out / f"{names[2]}.json").read_text())
    assert compiled["dynamo_frames_warmup"] > 0  # the blocks were compiled during warm-up


@pytest.mark.slow
def test_benchmark_tiny_table(tiny_run):
    out, _ = tiny_run
    table = (out / "results.md").read_text()
    assert "SpecForge dflash (anchor)" in table and "| 395 | 5.06 |" in table
    for variant in ("eager", "static", "compile"):
        # the run's `--` overrides are part of what each row measured
        assert f"| dflash2 (tiny) | varmask | 2 | synthetic | {variant} --compile.backend aot_eager |" in table
    header = next(line for line in table.splitlines() if line.startswith("| draft"))
    for column in ("step ms", "samples/s", "× anchor", "MFU %", "peak alloc GiB", "data wait ms (%)",
                   "warm-up s", "recompiles"):
        assert column in header
    assert "torch " + torch.__version__ in table


def test_default_matrix_ladder_and_side_rows():
    """The default run: every variant in both modes at accum 1 on synthetic features, then accum 4
    and the online target as eager/float8 side rows in the first mode (varmask)."""
    bench = _load_benchmark_module()
    cases = bench.build_cases(bench.parse_args([]))
    names = [c.name for c in cases]
    assert len(names) == len(set(names)) == 24
    for draft in ("dflash", "dflash2"):
        for mode in ("varmask", "fixed"):
            for variant in ("eager", "static", "compile", "float8"):
                assert f"{draft}-{mode}-acc1-synthetic-{variant}" in names
        side = [n for n in names if n.startswith(f"{draft}-") and ("acc4" in n or "online" in n)]
        assert sorted(side) == sorted(f"{draft}-varmask-{row}-{v}" for row in ("acc4-synthetic", "acc1-online")
                                      for v in ("eager", "float8"))
    # every eager row comes before the variants compared with it (the table divides by it)
    assert names.index("dflash-varmask-acc1-online-eager") < names.index("dflash-varmask-acc1-online-float8")
    everything = bench.build_cases(bench.parse_args(["--side-variants", "all"]))
    assert len(everything) == 2 * (2 * 4 + 4 + 4)
    only = bench.build_cases(bench.parse_args(["--accum", "4", "--targets", "online", "--modes", "fixed"]))
    assert {c.name for c in only} == {f"{d}-fixed-acc4-online-{v}" for d in ("dflash", "dflash2")
                                      for v in ("eager", "static", "compile", "float8")}
    for bad in (["--side-variants", "fast"], ["--variants", "eager,static", "--side-variants", "float8"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_a_failing_case_is_recorded_and_reported(tmp_path):
    """A case whose worker fails gets a JSON of its own (the case, the run, the log tail) and a
    line under the table; the benchmark itself goes on and exits 0."""
    cmd = [sys.executable, SCRIPT, "--tiny", "--drafts", "dflash", "--modes", "varmask", "--accum", "1",
           "--targets", "synthetic", "--variants", "eager", "--warmup", "0", "--steps", "1",
           "--out", str(tmp_path), "--", "--model.args.block_size", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    name = "tiny-dflash-varmask-acc1-synthetic-eager"
    r = json.loads((tmp_path / f"{name}.json").read_text())
    assert r["status"].startswith("failed (exit ") and r["name"] == name
    assert r["case"]["variant"] == "eager" and r["case"]["tiny"] is True
    assert (r["batch"], r["seq"], r["warmup"], r["steps"]) == (2, 64, 0, 1)
    assert r["extra_overrides"] == ["--model.args.block_size", "1"] and "scripts/benchmark.py" in r["command"]
    assert "block_size must be >= 2" in r["error_tail"]
    table = (tmp_path / "results.md").read_text()
    assert f"- {name}: failed (exit " in table and "block_size must be >= 2" in table


@pytest.mark.slow
def test_benchmark_tiny_under_torchrun(tmp_path):
    """The multi-GPU path on CPU: two torchrun ranks (gloo), fresh ranks per case; throughput is
    the total over ranks, the per-GPU figure half of it."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
           "--tiny", "--drafts", "dflash", "--modes", "varmask", "--accum", "1", "--targets", "synthetic",
           "--variants", "eager", "--warmup", "1", "--steps", "2", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a native abort in a rank prints its stacks
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    name = "tiny-dflash-varmask-acc1-synthetic-eager"
    r = json.loads((tmp_path / f"{name}.json").read_text())
    assert r["status"] == "ok" and r["world_size"] == 2
    # 2 ranks x batch 2 per optimizer step
    assert r["samples_per_s"] == pytest.approx(4 / (r["step_ms_median"] / 1e3), rel=1e-6)
    assert r["samples_per_s_per_gpu"] == pytest.approx(r["samples_per_s"] / 2, rel=1e-6)
    assert (tmp_path / "logs" / f"{name}.rank1.log").is_file()
    assert "--nproc_per_node 2" in r["command"]
    assert "| dflash (tiny) | varmask | 1 | synthetic | eager |" in (tmp_path / "results.md").read_text()


def test_report_merges_folders_and_shows_failures(tmp_path):
    bench = _load_benchmark_module()
    ok = {
        "schema": bench.SCHEMA, "name": "dflash-varmask-acc1-synthetic-eager", "status": "ok",
        "case": {"draft": "dflash", "mode": "varmask", "accum": 1, "target": "synthetic", "variant": "eager",
                 "tiny": False},
        "date": "2026-11-29T10:00:00+00:00", "command": "python scripts/benchmark.py", "torch": "2.11.0",
        "device_name": "NVIDIA H200", "world_size": 1, "step_ms_median": 400.0, "samples_per_s": 5.0,
        "samples_per_s_per_gpu": 5.0, "tokens_per_s": 10240.0, "model_tflop_per_step": 140.3,
        "achieved_tflops": 350.8, "mfu_pct": 35.5, "peak_allocated_gib": 30.0, "peak_reserved_gib": 32.0,
        "data_wait_ms_mean": 0.5, "data_wait_pct": 0.1, "compile_warmup_s": 20.0, "recompiles_after_warmup": 0,
    }
    fast = dict(ok, name="dflash-varmask-acc1-synthetic-float8", step_ms_median=200.0, samples_per_s=10.0,
                samples_per_s_per_gpu=10.0, case=dict(ok["case"], variant="float8"))
    failed = {"schema": bench.SCHEMA, "name": "dflash-varmask-acc1-synthetic-compile", "status": "timeout (420 s)",
              "case": dict(ok["case"], variant="compile"), "date": ok["date"],
              "error_tail": "Traceback\nRuntimeError: boom\nmore output"}
    (tmp_path / "chunk1").mkdir()
    (tmp_path / "chunk1" / "a.json").write_text(json.dumps(ok))
    (tmp_path / "b.json").write_text(json.dumps(fast))
    (tmp_path / "c.json").write_text(json.dumps(failed))
    (tmp_path / "unrelated.json").write_text(json.dumps({"x": 1}))
    # an ablation in its own folder: the same case with an extra override is another row, and an
    # older run of the plain case loses to the newer one
    extra = ["--parallelism.fsdp_reshard_after_forward", "never"]
    (tmp_path / "ablation").mkdir()
    (tmp_path / "ablation" / "b.json").write_text(json.dumps(dict(fast, step_ms_median=190.0, extra_overrides=extra)))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "b.json").write_text(json.dumps(dict(fast, step_ms_median=999.0, date="2026-11-28")))
    table = open(bench.write_report(str(tmp_path))).read()
    from scripts.benchmark_report import VARIANT_ORDER  # importable once bench put the repo on sys.path

    assert tuple(bench.VARIANTS) == VARIANT_ORDER  # the table orders every variant the CLI runs
    rows = [line for line in table.splitlines() if line.startswith("| dflash |")]
    assert [row.split(" | ")[4] for row in rows] == [
        "eager", "compile", "float8", "float8 --parallelism.fsdp_reshard_after_forward never"]
    assert "| 200.0 |" in rows[2] and "| 190.0 |" in rows[3] and "999" not in table
    assert rows[3].split(" | ")[8] == "–"  # × eager: there is no eager row with that override
    rows = rows[:3]
    assert rows[0].split(" | ")[8] == "1.00"  # the eager row against itself
    assert "| 2.00 |" in rows[2]  # float8 vs eager
    assert "| 1.98 |" in rows[2]  # 10.0 samples/s over the anchor's 5.06
    assert "timeout (420 s)" in rows[1] and "RuntimeError: boom" in table


@pytest.mark.parametrize("draft,samples_per_s,speedup,anchor", [
    ("dspark", 12.86, "2.00", "| SpecForge dspark (anchor) | varmask | 1 | synthetic | FSDP1 eager | 311 | 6.43 |"),
    ("eagle3", 12.08, "1.23", "| SpecForge eagle3 (anchor) | varmask | 1 | synthetic | FSDP1 eager | 203 | 9.85 |"),
])
def test_rows_compare_with_specforge_of_the_same_algorithm(tmp_path, draft, samples_per_s, speedup, anchor):
    """A DSpark (EAGLE-3) row's × anchor is over SpecForge's DSpark (EAGLE-3) step, not DFlash's,
    and that anchor's row is shown; the default matrix stays DFlash / DFlash2."""
    bench = _load_benchmark_module()
    row = {
        "schema": bench.SCHEMA, "name": f"{draft}-varmask-acc1-synthetic-compile", "status": "ok",
        "case": {"draft": draft, "mode": "varmask", "accum": 1, "target": "synthetic", "variant": "compile",
                 "tiny": False},
        "date": "2026-12-01T10:00:00+00:00", "command": f"python scripts/benchmark.py --drafts {draft}",
        "torch": "2.13.0", "device_name": "NVIDIA H200", "world_size": 1, "step_ms_median": 155.5,
        "samples_per_s": samples_per_s, "samples_per_s_per_gpu": samples_per_s, "tokens_per_s": 26337.0,
        "model_tflop_per_step": 74.8, "achieved_tflops": 481.0, "mfu_pct": 48.6, "peak_allocated_gib": 30.0,
        "peak_reserved_gib": 31.0, "data_wait_ms_mean": 0.5, "data_wait_pct": 0.3, "compile_warmup_s": 30.0,
        "recompiles_after_warmup": 0,
    }
    (tmp_path / "a.json").write_text(json.dumps(row))
    table = open(bench.write_report(str(tmp_path))).read()
    (line,) = [x for x in table.splitlines() if x.startswith(f"| {draft} |")]
    assert line.split(" | ")[7] == speedup  # over that algorithm's SpecForge samples/s
    assert anchor in table and "SpecForge dflash (anchor)" in table
    assert {c.draft for c in bench.build_cases(bench.parse_args([]))} == {"dflash", "dflash2"}
    (case,) = bench.build_cases(bench.parse_args(["--drafts", draft, "--modes", "varmask", "--accum", "1",
                                                  "--targets", "synthetic", "--variants", "float8"]))
    argv = case.overrides(2, 2048, 13, "/tmp/x")
    assert argv[argv.index("--model.name") + 1] == draft and argv[argv.index("--model.flavor") + 1] == "qwen3_8b"


@pytest.mark.slow
def test_benchmark_tiny_dspark(tmp_path):
    """The DSpark row runs through the benchmark's real Trainer at the tiny shape on CPU (the
    synthetic target gives it final-norm hidden states too)."""
    cmd = [sys.executable, SCRIPT, "--tiny", "--drafts", "dspark", "--modes", "varmask", "--accum", "1",
           "--targets", "synthetic", "--variants", "eager,static", "--warmup", "1", "--steps", "2",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for variant in ("eager", "static"):
        r = json.loads((tmp_path / f"tiny-dspark-varmask-acc1-synthetic-{variant}.json").read_text())
        assert r["status"] == "ok" and r["model_tflop_per_step"] > 0 and r["step_ms_median"] > 0
    assert "| dspark (tiny) | varmask | 1 | synthetic | static |" in (tmp_path / "results.md").read_text()


def test_real_data_modes_and_padding_figures():
    """A mode names synthetic rows, the packaged ShareGPT or a chat file; the padding share and the
    real-token rate come from the records (conversations and real tokens, not row positions)."""
    from scripts.benchmark import Case, data_source
    from scripts.benchmark_worker import summarize

    assert data_source("varlen") == "synthetic:varlen" and data_source("sharegpt") == "sharegpt"
    assert data_source("/data/first.jsonl") == "/data/first.jsonl"
    case = Case("dflash2", "/data/first.jsonl", 1, "synthetic", "packed", tiny=True)
    assert case.name == "tiny-dflash2-first-acc1-synthetic-packed"
    assert "--data.packing" in case.overrides(2, 128, 4, "/tmp/x")
    rec = {"data_s": 0.0, "compute_s": 0.5, "step_s": 0.5, "samples": 7, "tokens": 192, "positions": 256,
           "dynamo_frames": 0, "peak_allocated": None, "peak_reserved": None, "seq_lens": [128]}
    r = summarize([rec] * 3, 1, 2, world=1, flops_per_step=1.0, peak_flops=None)
    assert r["padding_pct"] == pytest.approx(25.0)
    assert r["tokens_per_s"] == pytest.approx(384.0) and r["samples_per_s"] == pytest.approx(14.0)


@pytest.mark.slow
def test_benchmark_tiny_moe_target(tmp_path):
    """The online_moe row runs a real Trainer against a random-weight Qwen3-MoE target (the tiny
    flavor on CPU), and run_info names that target."""
    cmd = [sys.executable, SCRIPT, "--tiny", "--drafts", "dflash2", "--modes", "varmask", "--accum", "1",
           "--targets", "online_moe", "--variants", "eager", "--warmup", "0", "--steps", "2", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    r = json.loads((tmp_path / "tiny-dflash2-varmask-acc1-online_moe-eager.json").read_text())
    assert r["status"] == "ok" and r["run_info"]["target"] == "random:debugmodel"
    assert r["overrides"][r["overrides"].index("--target.family") + 1] == "qwen3_moe"
    assert math.isfinite(r["final_loss"]) and r["step_ms_median"] > 0


@pytest.mark.parametrize("target_case", ["online_moe", "synthetic_moe"])
@pytest.mark.parametrize("draft", ["dflash", "dflash2", "eagle3", "dspark"])
def test_moe_target_row_fits_each_production_draft_to_its_width(draft, target_case, tok):
    """At the production shape the online_moe case's job resolves: the Qwen3-8B-shaped draft
    flavor takes the Qwen3-30B-A3B target's width, and its capture layers lie in its 48 layers.
    synthetic_moe (the same draft on random features, subtracted to give the target's share)
    builds the same draft."""
    from titan_draft.components.model_args import resolve_model_args
    from titan_draft.data.chat.format import build_chat_format
    from titan_draft.protocols.model_spec import get_model_spec
    from titan_draft.protocols.target_spec import random_target_args

    bench = _load_benchmark_module()
    cfg = ConfigManager().parse_args(bench.Case(draft, "varmask", 1, target_case, "float8").overrides(2, 2048, 13, "/x"))
    target = random_target_args(cfg.target.family, cfg.target.flavor.removeprefix("synthetic:"))
    assert (cfg.target.family, target.num_experts, target.hidden_size) == ("qwen3_moe", 128, 2048)
    spec = get_model_spec(cfg.model.name)
    args = resolve_model_args(spec, cfg, target, tok, build_chat_format(cfg.data, tok))
    assert args.hidden_size == 2048
    with torch.device("meta"):
        spec.model_cls(args)  # the shapes fit together
