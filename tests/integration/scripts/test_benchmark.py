"""The benchmark (scripts/benchmark.py) and the synthetic source/target it runs on.

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

from titan_draft.features.synthetic import build_synthetic_target
from titan_draft.features.target import build_target
from titan_draft.config import ConfigManager
from titan_draft.data.pipeline import build_dataloader
from titan_draft.data.sources.synthetic import SyntheticSourceNode, synthetic_sample
from titan_draft.data.tokenizer import build_tokenizer
from helpers import REPO

SCRIPT = os.path.join(REPO, "scripts", "benchmark.py")


def _load_benchmark_module():
    """scripts/benchmark.py as a module (scripts/ is not an installed package)."""
    spec = importlib.util.spec_from_file_location("titan_draft_benchmark_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


# ---- synthetic source ----


def test_recorded_length_modes_follow_the_recorded_lengths(tmp_path):
    """first_exchange / conversation rows take their lengths from the recorded table: re-recorded
    from ShareGPT with scripts/length_histogram.py, the first rows match the packaged file, and
    the rows' padded fill at a max_length is the table's (truncation included)."""
    from titan_draft.data.sources.synthetic import recorded_lengths

    spec = importlib.util.spec_from_file_location("length_histogram", os.path.join(REPO, "scripts",
                                                                                   "length_histogram.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "first.json"
    script.main(["--cut", "first_exchange", "--rows", "40", "--out", str(out)])
    assert [tuple(p) for p in json.loads(out.read_text())["lengths"]] == recorded_lengths("first_exchange")[:40]
    for mode in ("first_exchange", "conversation"):
        table = recorded_lengths(mode)
        assert len(table) == 3000 and all(0 < loss <= n for n, loss in table)
        rows = [synthetic_sample(mode, 1024, seed=1, row=r) for r in range(1500)]
        fill = sum(len(ids) for ids, _ in rows) / (1024 * len(rows))
        want = sum(min(n, 1024) for n, _ in table) / (1024 * len(table))
        assert fill == pytest.approx(want, abs=0.03)
        for (ids, mask) in rows[:50]:
            prompt = mask.index(True)
            assert all(mask[prompt:]) and not any(mask[:prompt]) and len(ids) - prompt >= 2


@pytest.mark.parametrize("mode", ["fixed", "varmask", "varlen"])
def test_synthetic_sample_modes(mode):
    for row in range(20):
        ids, mask = synthetic_sample(mode, 128, seed=3, row=row)
        assert len(ids) == len(mask)
        assert all(0 <= i < 151643 for i in ids)
        if mode == "varlen":
            assert 16 <= len(ids) <= 128
        else:
            assert len(ids) == 128
        if mode == "fixed":
            assert all(mask)
        else:
            prompt = mask.index(True)
            # a prompt prefix of 20-80 %, then every token is supervised
            assert 0.2 * len(ids) - 1 <= prompt <= 0.8 * len(ids)
            assert all(mask[prompt:]) and not any(mask[:prompt])
    assert synthetic_sample(mode, 128, 3, 5) == synthetic_sample(mode, 128, 3, 5)
    assert synthetic_sample(mode, 128, 3, 5) != synthetic_sample(mode, 128, 4, 5)


def test_synthetic_dataloader_shapes_and_resume():
    cfg = ConfigManager().parse_args(["--data.source", "synthetic:varlen", "--data.max_length", "64",
                                      "--data.max_rows", "10"])
    kwargs = dict(dp_rank=1, dp_world=2, local_batch_size=2, seed=7, pad_multiple=16)
    loader = build_dataloader(cfg.data, build_tokenizer("qwen3"), static_shapes=False, **kwargs)
    assert loader.rows_per_rank == 5
    first = [next(loader) for _ in range(3)]
    for b in first:
        assert b["input_ids"].shape[1] % 16 == 0 and b["input_ids"].shape[1] <= 64
        assert b["loss_mask"].shape == b["input_ids"].shape
        assert int(b["valid_lengths"].max()) <= b["input_ids"].shape[1]
    assert loader.epoch == 1 and sum(loader.skip_counts.values()) == 0
    state = loader.state_dict()
    expected = [next(loader) for _ in range(2)]
    resumed = build_dataloader(cfg.data, build_tokenizer("qwen3"), static_shapes=False, **kwargs)
    resumed.load_state_dict(state)
    for want, got in zip(expected, [next(resumed) for _ in range(2)]):
        for key in want:
            assert torch.equal(want[key], got[key])
    static = build_dataloader(cfg.data, build_tokenizer("qwen3"), static_shapes=True, **kwargs)
    assert next(static)["input_ids"].shape == (2, 64)


def test_synthetic_source_refuses_a_state_of_another_row_count():
    kwargs = dict(dp_rank=0, dp_world=1, local_batch_size=2, seed=7, static_shapes=True, pad_multiple=1)
    cfg = ConfigManager().parse_args(["--data.source", "synthetic:fixed", "--data.max_length", "16",
                                      "--data.max_rows", "10"])
    loader = build_dataloader(cfg.data, build_tokenizer("qwen3"), **kwargs)
    next(loader)
    cfg.data.max_rows = 12
    other = build_dataloader(cfg.data, build_tokenizer("qwen3"), **kwargs)
    with pytest.raises(ValueError, match=r"saved with 10 rows .* synthetic source now gives 12 \(data\.max_rows"):
        other.load_state_dict(loader.state_dict())


def test_synthetic_source_rejects_unknown_mode():
    cfg = ConfigManager().parse_args(["--data.source", "synthetic:nope"])
    with pytest.raises(ValueError, match="data.source"):
        build_dataloader(cfg.data, build_tokenizer("qwen3"), dp_rank=0, dp_world=1, local_batch_size=2, seed=0,
                         static_shapes=True, pad_multiple=1)
    with pytest.raises(ValueError):
        SyntheticSourceNode("nope", num_rows=4, max_length=8, seed=0, dp_rank=0, dp_world=1)
    cfg = ConfigManager().parse_args(["--data.source", "synthetic:fixed", "--data.max_rows", "1"])
    with pytest.raises(ValueError, match="data.max_rows: 1 synthetic rows leave some of the 2 DP ranks"):
        build_dataloader(cfg.data, build_tokenizer("qwen3"), dp_rank=1, dp_world=2, local_batch_size=2, seed=0,
                         static_shapes=True, pad_multiple=1)


# ---- synthetic target ----


def test_synthetic_target_features_and_tables():
    cfg = ConfigManager().parse_args(["--target.flavor", "synthetic:debugmodel"])
    bundle = build_target(cfg, torch.device("cpu"), torch.float32)
    assert bundle.source == "synthetic:debugmodel" and bundle.family == "qwen3"
    assert list(bundle.model.parameters()) == []  # nothing for the target's FSDP wrapping to shard
    a = bundle.args
    ids = torch.zeros(2, 24, dtype=torch.long)
    aux, last = bundle.model.capture(ids, [1, 3], False)
    assert aux.shape == (2, 24, 2 * a.hidden_size) and aux.dtype == torch.float32 and last is None
    aux2, last = bundle.model.capture(ids, [0], True)
    assert aux2.shape == (2, 24, a.hidden_size) and last.shape == (2, 24, a.hidden_size)
    # the same checks as a real target's capture
    with pytest.raises(ValueError, match=rf"capture layer ids \[{a.num_hidden_layers}\] out of range"):
        bundle.model.capture(ids, [0, a.num_hidden_layers], False)
    with pytest.raises(ValueError, match="layer_ids is empty"):
        bundle.model.capture(ids, [], False)
    embed, head = bundle.model.embed_weight(), bundle.model.lm_head_weight()
    assert embed.shape == (a.vocab_size, a.hidden_size)
    assert torch.equal(embed, bundle.model.embed_weight())  # seeded: the same table every call
    assert torch.equal(embed, head) == a.tie_word_embeddings


def test_synthetic_target_rejects_unknown_flavor():
    cfg = ConfigManager().parse_args(["--target.flavor", "synthetic:nope"])
    with pytest.raises(ValueError, match="target.flavor"):
        build_synthetic_target(cfg, torch.device("cpu"), torch.float32)


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


def _trace_summary():
    """scripts/trace_summary.py as a module (scripts/ is not a package path)."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import trace_summary
    finally:
        sys.path.pop(0)
    return trace_summary


def test_trace_summary_busy_time_and_categories():
    """scripts/trace_summary.py: overlapping kernels count once in busy time; kernels land in
    their categories; blocking runtime calls are counted."""
    trace_summary = _trace_summary()
    ev = lambda name, cat, ts, dur: {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}  # noqa: E731
    trace = {"traceEvents": [
        ev("ProfilerStep#1", "user_annotation", 0, 1000),
        ev("nvjet_sm90_tst_320x128_TNT", "kernel", 0, 300),
        ev("triton_tem_fused_flex_attention_backward", "kernel", 200, 200),  # overlaps by 100
        ev("multi_tensor_apply_kernel<FusedOptimizer>", "kernel", 600, 100),
        ev("cudaStreamSynchronize", "cuda_runtime", 700, 5),
    ]}
    text = trace_summary.summarize(trace, top=5)
    assert "wall 1.0 ms, GPU busy 0.5 ms (50.0%), kernels 3" in text
    assert "matmul" in text and "attention" in text and "optimizer" in text
    assert trace_summary.category("triton_tem_fused_flex_attention_backward") == "attention"
    assert trace_summary.category("nvjet_sm90_tst_320x128") == "matmul"
    assert "cudaStreamSynchronize x1 0.0 ms" in text


def _event(name, cat, ts, dur, tid=1, **args):
    """One complete ("X") event of a torch profiler trace, on thread ``tid`` of process 0."""
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def test_trace_summary_charges_gpu_idle_time_to_the_host_op_under_each_gap():
    """Inside the profiled step, each gap between kernels goes to the innermost host op spanning
    its middle on the thread that launched the kernel after it; time outside the steps is not
    counted, and a blocking call's host time is summed."""
    trace_summary = _trace_summary()

    trace = {"traceEvents": [
        _event("ProfilerStep#3", "user_annotation", 0, 1000),
        _event("aten::item", "cpu_op", 100, 200),
        _event("cudaStreamSynchronize", "cuda_runtime", 110, 40),
        _event("Optimizer.step#AdamW.step", "user_annotation", 400, 300),
        _event("aten::_foreach_add_", "cpu_op", 450, 200, **{"Input Dims": [[8], [8]]}),
        _event("cudaLaunchKernel", "cuda_runtime", 290, 5, correlation=2),
        _event("cudaLaunchKernel", "cuda_runtime", 690, 5, correlation=3),
        _event("k1", "kernel", 0, 100, tid=7, correlation=1),
        _event("k2", "kernel", 300, 100, tid=7, correlation=2),
        _event("k3", "kernel", 700, 300, tid=7, correlation=3),
        _event("k4", "kernel", 1500, 10, tid=7, correlation=4),  # after the step: its gap is not counted
    ]}
    text = trace_summary.summarize(trace, top=5)
    gaps = text.split("GPU idle inside the profiled steps: ")[1].split("host runtime calls")[0]
    lines = [" ".join(line.split()) for line in gaps.strip().splitlines()]
    assert lines[0].startswith("0.5 ms")
    assert lines[1:] == ["0.3 ms 1x aten::_foreach_add_ [[8], [8]]", "0.2 ms 1x aten::item"]
    assert "cudaStreamSynchronize x1 0.0 ms" in text


def test_trace_summary_charges_kernels_to_the_innermost_launching_op():
    """Each kernel's GPU time goes to the innermost host op around its launch on the launching
    thread (matched by correlation id), labelled with its input shapes; a launch outside every
    op is counted apart."""
    trace_summary = _trace_summary()

    trace = {"traceEvents": [
        _event("aten::linear", "cpu_op", 0, 100, **{"Input Dims": [[4, 8], [16, 8], []]}),
        _event("aten::mm", "cpu_op", 10, 50, **{"Input Dims": [[4, 8], [8, 16]]}),
        _event("cudaLaunchKernel", "cuda_runtime", 20, 2, correlation=1),  # inside aten::mm
        _event("cudaLaunchKernel", "cuda_runtime", 80, 2, correlation=2),  # after mm, inside linear
        _event("aten::_log_softmax_backward_data", "cpu_op", 0, 40, tid=2, **{"Input Dims": [[4, 16], [4, 16]]}),
        _event("cudaLaunchKernel", "cuda_runtime", 5, 2, tid=2, correlation=3),  # the backward thread
        _event("cudaLaunchKernel", "cuda_runtime", 500, 2, correlation=4),  # no op around it
        _event("nvjet_gemm", "kernel", 100, 30, tid=7, correlation=1),
        _event("add_kernel", "kernel", 130, 5, tid=7, correlation=2),
        _event("softmax_bwd", "kernel", 140, 20, tid=7, correlation=3),
        _event("memset", "kernel", 600, 1, tid=7, correlation=4),
    ]}
    text = trace_summary.summarize(trace, top=10)
    ops = text.split("launching host ops")[1].split("host runtime calls")[0]
    assert "0.0 ms     1x  aten::mm [[4, 8], [8, 16]]" in ops
    assert "aten::linear [[4, 8], [16, 8]]" in ops
    assert "aten::_log_softmax_backward_data [[4, 16], [4, 16]]" in ops
    assert "(no host op)" in ops
    # ordered by GPU time: the mm's 30 us first, then the backward's 20
    assert ops.index("aten::mm") < ops.index("_log_softmax_backward_data") < ops.index("aten::linear")
    # the mm's 2 * 4 * 8 * 16 FLOP in its kernel's 30 us; no warning without a peak, one above it
    assert "aten::mm [[4, 8], [8, 16]]  [0 TFLOP/s]" in ops and "WARNING" not in text
    assert trace_summary.gemm_flops({"name": "aten::mm", "args": {"Input Dims": [[4, 8], [8, 16]]}}) == 1024
    assert trace_summary.gemm_flops({"name": "aten::addmm", "args": {"Input Dims": [[16], [4, 8], [8, 16]]}}) == 1024
    assert trace_summary.gemm_flops({"name": "aten::bmm", "args": {"Input Dims": [[3, 4, 8], [3, 8, 16]]}}) == 3072
    assert trace_summary.gemm_flops({"name": "aten::add", "args": {"Input Dims": [[4, 8], [4, 8]]}}) is None
    slow = trace_summary.summarize(trace, top=10, peak_tflops=1e-5)  # 1024 FLOP / 30 us = 3.4e-5
    assert "WARNING: 1 GEMM op(s) imply more than the peak" in slow and "aten::mm [[4, 8], [8, 16]]" in slow
    assert "WARNING" not in trace_summary.summarize(trace, top=10, peak_tflops=1e-4)
    # a float8 GEMM is held to twice the peak: the same rate warns only below half of it
    trace["traceEvents"][1]["name"] = "aten::_scaled_mm"
    assert "WARNING" not in trace_summary.summarize(trace, top=10, peak_tflops=2e-5)
    assert "WARNING: 1 GEMM" in trace_summary.summarize(trace, top=10, peak_tflops=1.6e-5)


def test_trace_summary_names_the_ops_that_issue_blocking_calls():
    """Blocking runtime calls (copies, synchronizes) are totalled by name and then charged to the
    innermost host op around them, ordered by the host time spent in them."""
    trace_summary = _trace_summary()

    trace = {"traceEvents": [
        _event("aten::item", "cpu_op", 0, 900),
        _event("aten::_local_scalar_dense", "cpu_op", 5, 890),
        _event("cudaMemcpyAsync", "cuda_runtime", 10, 800, correlation=1),  # waited 0.8 ms in .item()
        _event("aten::copy_", "cpu_op", 1000, 300, **{"Input Dims": [[2, 7], [2, 7]]}),
        _event("cudaMemcpyAsync", "cuda_runtime", 1010, 100, correlation=2),
        _event("aten::copy_", "cpu_op", 1400, 300, **{"Input Dims": [[2, 7], [2, 7]]}),
        _event("cudaMemcpyAsync", "cuda_runtime", 1410, 150, correlation=3),
        _event("cudaStreamSynchronize", "cuda_runtime", 2000, 50, correlation=4),  # outside every op
        _event("cudaLaunchKernel", "cuda_runtime", 2100, 2, correlation=5),  # not a blocking call
        _event("k", "kernel", 2200, 10, tid=7, correlation=5),
    ]}
    text = trace_summary.summarize(trace, top=5).split("host runtime calls that can block")[1]
    assert "cudaMemcpyAsync x3 1.1 ms" in text and "cudaStreamSynchronize x1 0.1 ms" in text
    callers = [line.strip() for line in text.split("issued them")[1].splitlines()[1:]]
    assert callers[0].startswith("0.8 ms     1x  cudaMemcpyAsync in aten::_local_scalar_dense")
    assert callers[1].startswith("0.2 ms     2x  cudaMemcpyAsync in aten::copy_ [[2, 7], [2, 7]]")
    assert callers[2].startswith("0.1 ms     1x  cudaStreamSynchronize in (no host op)")
    assert len(callers) == 3  # the kernel launch is not a blocking call


def test_trace_summary_named_regions():
    """Per region the trainer names: host time, GPU span, and only the kernel time inside the span
    (overlaps counted once; a kernel straddling the span's end counts up to it)."""
    trace_summary = _trace_summary()
    ev = lambda name, cat, ts, dur: {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}  # noqa: E731
    trace = {"traceEvents": [
        ev("titan_draft.features", "user_annotation", 0, 400),
        ev("titan_draft.features", "gpu_user_annotation", 100, 1000),
        ev("titan_draft.backward", "user_annotation", 400, 50),
        ev("titan_draft.backward", "gpu_user_annotation", 2000, 500),
        ev("other_annotation", "gpu_user_annotation", 0, 5000),
        ev("k1", "kernel", 100, 200),
        ev("k2", "kernel", 250, 100),  # overlaps k1 by 50
        ev("k3", "kernel", 850, 300),  # 250 of it inside the features span
        ev("k4", "kernel", 2100, 400),
    ]}
    regions = trace_summary.summarize(trace, top=5).split("named regions")[1].split("host runtime")[0]
    lines = [" ".join(line.split()) for line in regions.strip().splitlines()[1:]]
    # by GPU span; k1 + k2 count 250 us once, k3 up to the span's end
    assert lines == ["features host 0.4 ms GPU span 1.0 ms kernels 0.5 ms",
                     "backward host 0.1 ms GPU span 0.5 ms kernels 0.4 ms"]
    assert "other_annotation" not in regions
    assert "named regions" not in trace_summary.summarize({"traceEvents": trace["traceEvents"][5:]}, top=5)


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


@pytest.mark.parametrize("draft", ["dflash", "dflash2", "eagle3", "dspark"])
def test_moe_target_row_fits_each_production_draft_to_its_width(draft, tok):
    """At the production shape the online_moe case's job resolves: the Qwen3-8B-shaped draft
    flavor takes the Qwen3-30B-A3B target's width, and its capture layers lie in its 48 layers."""
    from titan_draft.components.model_args import resolve_model_args
    from titan_draft.data.chat.format import build_chat_format
    from titan_draft.protocols.model_spec import get_model_spec
    from titan_draft.protocols.target_spec import random_target_args

    bench = _load_benchmark_module()
    cfg = ConfigManager().parse_args(bench.Case(draft, "varmask", 1, "online_moe", "float8").overrides(2, 2048, 13, "/x"))
    target = random_target_args(cfg.target.family, cfg.target.flavor)
    assert (cfg.target.family, target.num_experts, target.hidden_size) == ("qwen3_moe", 128, 2048)
    spec = get_model_spec(cfg.model.name)
    args = resolve_model_args(spec, cfg, target, tok, build_chat_format(cfg.data, tok))
    assert args.hidden_size == 2048
    with torch.device("meta"):
        spec.model_cls(args)  # the shapes fit together
