"""scripts/compare_drafts.py without training: the budget arithmetic, the table from reports the
test writes, the equal-draft-tokens view, and the stages skipped or resumed on a second run (the
jobs replaced by a fake that writes what a real job writes: TensorBoard scalars through the
trainer's own metrics logger, and the export's provenance)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
from pathlib import Path

import pytest
import torch

from scripts import compare_drafts
from scripts.compare import runs as compare_runs
from scripts.compare.plan import (BudgetError, Calibration, RunMetrics, build_calibration, choose_steps,
                                  read_run_metrics)
from scripts.compare.report import build_row, eval_report_name, render_markdown
from titan_draft.protocols import get_model_spec
from compare_fakes import FakeJobs, eval_report, write_tb
from helpers import REPO

DEBUG = os.path.join(REPO, "train_configs", "debug_random.toml")


# ---- the budget ----


def test_steps_fill_the_budget_and_no_more():
    cal = Calibration(steps=60, warmup=10, wall_s=100.0, median_step_s=0.5)
    assert cal.setup_s == pytest.approx(100.0 - 60 * 0.5)
    for minutes, margin in ((6, 0.03), (12, 0.0), (3.0, 0.1)):
        budget = 60 * minutes
        steps = choose_steps("d", budget, cal, margin)
        usable = budget * (1 - margin)
        # the whole job (setup once, then the steps) fits; one more step would not
        assert cal.setup_s + steps * 0.5 <= usable < cal.setup_s + (steps + 1) * 0.5
    assert choose_steps("d", 360, cal, 0.03) == 558  # (360 * 0.97 - 70) / 0.5 = 558.4


def test_periodic_saves_are_paid_from_the_budget():
    # the calibration saved once halfway, which cost 2 s on top of the step after it
    cal = Calibration(steps=60, warmup=10, wall_s=102.0, median_step_s=0.5, save_step=35, save_s=2.0)
    assert cal.setup_s == pytest.approx(102.0 - 60 * 0.5 - 2.0)
    for interval in (1, 7, 50, 100, 10_000):
        steps = choose_steps("d", 360, cal, 0.03, interval)
        job = cal.setup_s + steps * 0.5 + ((steps - 1) // interval) * 2.0  # a save at every interval but the last step
        assert job == pytest.approx(cal.job_s(steps, interval))
        assert job <= 360 * 0.97 < cal.job_s(steps + 1, interval)
    assert choose_steps("d", 360, cal, 0.03, 100) < choose_steps("d", 360, cal, 0.03, 0)


def test_a_budget_smaller_than_the_setup_is_refused_in_one_line():
    cal = Calibration(steps=60, warmup=10, wall_s=100.0, median_step_s=0.5)
    with pytest.raises(BudgetError) as e:
        choose_steps("dspark_smollm2", 60.0, cal, 0.03)  # 58.2 s usable, 70 s of setup
    line = str(e.value)
    assert "\n" not in line and "dspark_smollm2" in line and "1.00 min" in line and "1.17 min" in line
    need = float(line.rsplit("--minutes ", 1)[1].split()[0])
    assert choose_steps("d", 60 * need, cal, 0.03) >= 1  # the budget it names is enough
    with pytest.raises(BudgetError):
        choose_steps("d", 60 * (need - 0.01), cal, 0.03)  # and the least it can name


def test_calibration_median_leaves_out_the_warmup_steps():
    times = {1: 30.0, 2: 4.0, 3: 0.52, 4: 0.48, 5: 0.50, 6: 2.0, 7: 0.49}
    cal = build_calibration(RunMetrics(step_times=times, peaks={}), steps=7, warmup=2, wall_s=50.0)
    assert cal.median_step_s == statistics.median([0.52, 0.48, 0.50, 2.0, 0.49])
    with pytest.raises(BudgetError, match="did not finish"):
        build_calibration(RunMetrics(step_times=times, peaks={}), steps=9, warmup=2, wall_s=50.0)
    # saved after step 5: step 6 carries the save, which is not a step's time
    cal = build_calibration(RunMetrics(step_times=times, peaks={}), steps=7, warmup=2, wall_s=50.0, save_step=5)
    assert cal.median_step_s == statistics.median([0.52, 0.48, 0.50, 0.49])
    assert cal.save_s == pytest.approx(2.0 - cal.median_step_s)
    assert cal.setup_s == pytest.approx(50.0 - 7 * cal.median_step_s - cal.save_s)


def test_step_times_and_peaks_are_read_from_the_trainers_tensorboard_scalars(tmp_path):
    times = [3.0, 0.25, 0.5, 0.75]
    write_tb(str(tmp_path), times)
    metrics = read_run_metrics(str(tmp_path / "tb" / "run"))
    assert metrics.step_times == pytest.approx(dict(enumerate(times, start=1)))
    assert metrics.peaks["peak_rss_gib"] > 0  # on CPU the memory monitor's peak is the RSS
    with pytest.raises(BudgetError, match="no TensorBoard logs"):
        read_run_metrics(str(tmp_path / "nowhere"))


# ---- the table ----


def test_the_table_row_comes_from_the_training_record_and_the_eval_reports(tmp_path):
    folder = tmp_path / "dspark"
    folder.mkdir()
    (folder / "train.json").write_text(json.dumps({"steps": 900, "wall_s": 345.0, "attempts": 1,
                                                   "median_step_ms": 81.5, "peaks_gib": {"max_allocated_gib": 10.2,
                                                                                        "max_reserved_gib": 10.7}}))
    greedy = eval_report(0.0, [5, 4], [16, 12], [[2, 1, 0, 3, 4], [1, 1, 0, 2]], [True, False])
    sampled = eval_report(1.0, [6, 6], [16, 15], [[1, 1, 0, 2, 1, 1], [0, 1, 1, 2, 1, 0]], None)
    speed = eval_report(0.0, [5, 4], [16, 12], [[2, 1, 0, 3, 4], [1, 1, 0, 2]], [True, True], times=(0.5, 2.0))
    for t, dtype, rep in ((0.0, "float32", greedy), (1.0, "float32", sampled), (0.0, "bfloat16", speed)):
        (folder / eval_report_name(t, dtype)).write_text(json.dumps(rep))
    row = build_row(str(folder), "dspark_smollm2", {"draft": "dspark", "budget_min": 6.0}, [0.0, 1.0], "bfloat16")

    assert row["steps"] == 900 and row["training_min"] == pytest.approx(345.0 / 60)
    # tau: tokens that verify rounds produced over rounds, over all prompts
    assert row["evals"]["0"]["tau"] == pytest.approx((15 + 11) / (5 + 4))
    assert row["evals"]["1"]["tau"] == pytest.approx((15 + 14) / (6 + 6))
    # accepted per position k: rounds that accepted at least k tokens, over all rounds
    assert row["evals"]["0"]["accept_rate"][:3] == pytest.approx([7 / 9, 4 / 9, 2 / 9])
    assert row["evals"]["0"]["lossless_prompts"] == 1 and row["evals"]["1"]["lossless_prompts"] is None
    assert row["speed"]["dtype"] == "bfloat16"
    assert row["speed"]["speculative_tokens_per_s"] == pytest.approx(28 / 1.0)  # from the bf16 report
    assert row["speed"]["ratio"] == pytest.approx((28 / 1.0) / (28 / 4.0))

    meta = {"view": "recipes", "minutes": 6.0, "calibration_steps": 60, "prompts": "mtbench",
            "max_new_tokens": 256, "temperatures": [0.0, 1.0], "seed": 0, "speed_dtype": "bfloat16", "date": "d"}
    md = render_markdown([row], meta)
    def cells_of(start):
        return [c.strip() for c in next(ln for ln in md.splitlines() if ln.startswith(start)).strip("|").split("|")]

    cells, head = cells_of("| dspark_smollm2"), cells_of("| draft")
    got = dict(zip(head, cells))
    assert got["draft"] == "dspark_smollm2" and got["steps"] == "900" and got["training min"] == "5.75"
    assert got["setup s"] == f"{345.0 - 900 * 0.0815:.0f}"  # the job's time outside its steps
    assert got["τ T=0"] == f"{26 / 9:.3f}" and got["τ T=1"] == f"{29 / 12:.3f}"
    assert got["lossless (T=0, fp32)"] == "1/2" and got["peak GiB"] == "10.2 / 10.7"
    assert got["accepted per position (T=0)"].startswith(f"{7 / 9:.2f} / {4 / 9:.2f}")
    assert got["ratio"] == "4.00×" and got["speculative tok/s (bf16)"] == "28.0"


def test_a_missing_report_leaves_its_cells_empty(tmp_path):
    row = build_row(str(tmp_path), "eagle3", {"budget_min": 6.0}, [0.0, 1.0], None)
    assert row["steps"] is None and row["evals"] == {} and row["speed"] is None
    meta = {"view": "recipes", "minutes": 6.0, "calibration_steps": 60, "prompts": "mtbench",
            "max_new_tokens": 256, "temperatures": [0.0, 1.0], "seed": 0, "date": "d"}
    assert render_markdown([row], meta).splitlines()[-1].count("–") == 12


def test_a_row_over_its_budget_is_named_with_its_step_against_the_calibrations(tmp_path):
    """Four jobs sharing one GPU each calibrated under another share than their training got
    (2026-12-07): the table must say which rows had more time, and why that may be."""
    meta = {"view": "recipes", "minutes": 7.0, "calibration_steps": 60, "prompts": "mtbench",
            "max_new_tokens": 256, "temperatures": [0.0], "seed": 0, "date": "d"}
    rows = []
    for label, wall, step in (("shared", 636.0, 227.0), ("alone", 400.0, 120.5)):
        folder = tmp_path / label
        folder.mkdir()
        (folder / "train.json").write_text(json.dumps({"steps": 2855, "wall_s": wall, "median_step_ms": step}))
        (folder / "plan.json").write_text(json.dumps({"predicted_job_s": 407.4, "calibration": {
            "median_step_s": 0.1199, "setup_s": 62.5, "save_s": 1.3}}))
        rows.append(build_row(str(folder), label, {"budget_min": 7.0}, [0.0], None))
    (note,) = [line for line in render_markdown(rows, meta).splitlines() if line.startswith("Over the budget")]
    assert note.startswith("Over the budget: shared (10.60 of 7 min; median step 227.0 ms, the calibration's 119.9). ")
    assert "another process on the GPU" in note and "alone" not in note
    assert not any(line.startswith("Over the budget") for line in render_markdown(rows[1:], meta).splitlines())


# ---- the runs of a view ----


def test_equal_draft_tokens_view_sets_each_drafts_own_setting_of_equal_drafted_tokens(job):
    configs = ",".join(os.path.join(REPO, "train_configs", n) for n in
                       ("debug_random.toml", "dspark_debug.toml", "eagle3_debug.toml"))
    a, extra = compare_drafts.parse_args(["--minutes", "1", "--configs", configs, "--view", "equal-draft-tokens", *job])
    runs = {r["label"]: r["cfg"] for r in compare_runs.build_runs(a, extra, print)}
    assert {k: v.model.args.get("block_size", v.model.args.get("ttt_steps")) for k, v in runs.items()} == {
        "debug_random-drafted7": 8, "debug_random-drafted15": 16,
        "dspark_debug-drafted7": 7, "dspark_debug-drafted15": 15,
        "eagle3_debug-drafted7": 7, "eagle3_debug-drafted15": 15}
    # each setting drafts the view's tokens per round, as the draft's own proposer counts them
    for label, cfg in runs.items():
        spec = get_model_spec(cfg.model.name)
        args = dataclasses.replace(spec.flavors[cfg.model.flavor], **cfg.model.args, vocab_size=256,
                                   target_layer_ids=[1], num_target_layers=2)
        with torch.device("cpu"):
            draft = spec.model_cls(args)
        draft.load_frozen_tables(torch.randn(256, args.hidden_size), torch.randn(256, args.hidden_size))
        assert spec.build_proposer_fn(draft.eval()).num_draft_tokens == int(label.rsplit("drafted", 1)[1]), label
    for key in ("block_size", "ttt_steps"):  # the view's own settings are not overridden
        a, extra = compare_drafts.parse_args(["--minutes", "1", "--configs", configs, "--view", "equal-draft-tokens",
                                              *job, f"--model.args.{key}", "3"])
        with pytest.raises(compare_runs.CompareError, match=f"--model.args.{key} is set by the equal-draft-tokens"):
            compare_runs.build_runs(a, extra, print)


@pytest.mark.parametrize("extra, expect", [
    (["--training.steps", "5"], "--training.steps is set by the comparison"),
    (["--no-eval.enable"], "--eval.enable is set by the comparison"),
    (["--training.epochs", "2"], "--training.epochs is set by the comparison"),
    (["--model.args.nope", "1"], "debug_random: model.args: unknown dflash2 arg(s) ['nope']"),
    (["--data.max_length", "4"], "debug_random: data.source: none of the first 200 rows"),
])
def test_bad_requests_are_one_line_errors_before_any_job(tmp_path, capsys, monkeypatch, job, extra, expect):
    jobs = FakeJobs()
    monkeypatch.setattr(compare_drafts, "run_logged", jobs)
    status = compare_drafts.main(["--minutes", "1", "--configs", DEBUG, "--out", str(tmp_path), *job, *extra])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and err.startswith("compare_drafts: error:") and expect in err
    assert jobs.calls == []


@pytest.mark.parametrize("old, new, expect", [
    ('source = "sharegpt"', 'source = "elsewhere.jsonl"', "data.source differs between the drafts"),
    ("steps = 150", "steps = 150\nepochs = 2", "training.epochs = 2: the comparison chooses training.steps"),
])
def test_configs_the_comparison_cannot_honour_are_refused(tmp_path, capsys, old, new, expect, random_target_dir):
    other = tmp_path / "other.toml"
    text = Path(DEBUG).read_text()
    assert old in text
    other.write_text(text.replace(old, new))
    status = compare_drafts.main(["--minutes", "1", "--configs", f"{DEBUG},{other}", "--out", str(tmp_path),
                                  "--target", random_target_dir])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and expect in err


# ---- resume and skip ----


def _compare(tmp_path, job, *extra):
    return compare_drafts.main(["--minutes", "1", "--configs", DEBUG, "--out", str(tmp_path / "out"), *job,
                                "--calibration-steps", "6", "--calibration-warmup", "2", *extra])


def test_finished_stages_are_skipped_and_a_stopped_training_resumes(tmp_path, monkeypatch, capsys, job):
    jobs = FakeJobs(stop_training_once=True)
    monkeypatch.setattr(compare_drafts, "run_logged", jobs)
    assert _compare(tmp_path, job) == 1
    assert "stopped before step" in capsys.readouterr().err
    assert [k for k, _ in jobs.calls] == ["calibration", "train"]
    calibration = jobs.calls[0][1]
    assert calibration[calibration.index("--checkpoint.interval") + 1] == "4"  # 2 warm-up + 4 // 2
    # each job compiles from an empty cache of its own, as the plan assumed
    (_, cal_cache, cal_warm), (_, run_cache, run_warm) = jobs.caches
    assert cal_cache != run_cache and not cal_warm and not run_warm

    jobs.calls.clear()
    assert _compare(tmp_path, job) == 0
    # the calibration is not run again; the training is the same command (it resumes)
    assert [k for k, _ in jobs.calls] == ["train", "eval", "eval"]
    greedy = [cmd[cmd.index("--greedy-cache") + 1] if "--greedy-cache" in cmd else None for _, cmd in jobs.calls[1:]]
    # T = 0 checks against the comparison's shared plain decodes; T = 1 decodes none
    assert greedy == [str(tmp_path / "out" / "greedy_float32.json"), None]
    folder = tmp_path / "out" / "debug_random"
    steps = json.loads((folder / "plan.json").read_text())["steps"]
    # a 40 s calibration of 6 steps of 0.5 s and a 2 s save after step 4 (halfway through the warm steps)
    assert steps == int((58.2 - (40.0 - 6 * 0.5 - 2.0)) / 0.5)
    assert jobs.calls[0][1][jobs.calls[0][1].index("--training.steps") + 1] == str(steps)
    row = json.loads((tmp_path / "out" / "table_recipes.json").read_text())["rows"][0]
    assert row["attempts"] == 2 and row["training_min"] == pytest.approx((20.0 + 35.0) / 60)
    assert row["plan"]["predicted_job_min"] == pytest.approx((35.0 + steps * 0.5) / 60)  # no save before the last
    assert row["plan"]["save_s"] == pytest.approx(2.0) and row["plan"]["calibration_median_step_ms"] == 500

    # a record lost after the job finished: read again from the job's files, not trained again
    (folder / "train.json").unlink()
    jobs.calls.clear()
    assert _compare(tmp_path, job) == 0 and [k for k, _ in jobs.calls] == ["eval", "eval"]
    assert json.loads((folder / "train.json").read_text())["wall_s"] == pytest.approx(55.0)

    jobs.calls.clear()
    table = (tmp_path / "out" / "table_recipes.md").read_text()
    assert _compare(tmp_path, job) == 0 and jobs.calls == []  # everything done: nothing runs
    assert (tmp_path / "out" / "table_recipes.md").read_text() == table

    (folder / eval_report_name(1.0, "float32")).unlink()
    assert _compare(tmp_path, job) == 0
    ((_, cmd),) = jobs.calls
    assert cmd[cmd.index("--temperature") + 1] == "1" and cmd[cmd.index("--seed") + 1] == "0"
    assert "--no-lossless-check" in cmd  # sampling: nothing to check token for token

    capsys.readouterr()
    jobs.calls.clear()
    assert _compare(tmp_path, job, "--margin", "0.1") == 2  # another budget: refused, nothing run or lost
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "was started for 1 min with margin 0.03" in err and jobs.calls == []
    assert json.loads((folder / "train.json").read_text())["steps"] == steps
    assert _compare(tmp_path, job, "--calibration-steps", "8") == 2  # another calibration: refused too
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "made with another calibration_steps" in err and jobs.calls == []


def test_new_eval_settings_redo_the_evals_only(tmp_path, monkeypatch, job):
    jobs = FakeJobs()
    monkeypatch.setattr(compare_drafts, "run_logged", jobs)
    assert _compare(tmp_path, job) == 0
    jobs.calls.clear()
    assert _compare(tmp_path, job, "--max-new-tokens", "64") == 0
    assert [k for k, _ in jobs.calls] == ["eval", "eval"]
    assert all(c[c.index("--max-new-tokens") + 1] == "64" for _, c in jobs.calls)

    jobs.calls.clear()  # the speed run adds its eval alone: greedy in bf16, with the plain decode it times
    assert _compare(tmp_path, job, "--max-new-tokens", "64", "--speed-dtype", "bfloat16") == 0
    ((kind, cmd),) = jobs.calls
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and cmd[cmd.index("--temperature") + 1] == "0"
    assert "--no-lossless-check" not in cmd
    row = json.loads((tmp_path / "out" / "table_recipes.json").read_text())["rows"][0]
    assert row["speed"]["dtype"] == "bfloat16"


def test_a_budget_below_the_calibrated_setup_stops_before_training(tmp_path, monkeypatch, capsys, job):
    jobs = FakeJobs()
    monkeypatch.setattr(compare_drafts, "run_logged", jobs)
    status = compare_drafts.main(["--minutes", "0.5", "--configs", DEBUG, "--out", str(tmp_path / "out"), *job,
                                  "--calibration-steps", "6", "--calibration-warmup", "2"])
    err = capsys.readouterr().err.strip()
    # 37 s of the 40 s calibration job were not steps; 0.5 min less 3 % leaves 29.1 s
    assert status == 2 and "\n" not in err and "a budget of 0.50 min leaves no time to train" in err
    assert [k for k, _ in jobs.calls] == ["calibration"]
    # the calibration is kept: a larger budget goes on from it
    status = compare_drafts.main(["--minutes", "1", "--configs", DEBUG, "--out", str(tmp_path / "out"), *job,
                                  "--calibration-steps", "6", "--calibration-warmup", "2"])
    assert status == 0 and [k for k, _ in jobs.calls] == ["calibration", "train", "eval", "eval"]


def test_the_time_of_an_interrupted_training_counts(tmp_path, monkeypatch, capsys, job):
    jobs = FakeJobs(interrupt_training_once=True)
    monkeypatch.setattr(compare_drafts, "run_logged", jobs)
    assert _compare(tmp_path, job) == 130
    assert "interrupted" in capsys.readouterr().err
    assert _compare(tmp_path, job) == 0
    row = json.loads((tmp_path / "out" / "table_recipes.json").read_text())["rows"][0]
    assert row["attempts"] == 2 and row["training_min"] == pytest.approx((12.0 + 35.0) / 60)
    assert [k for k, _ in jobs.calls] == ["calibration", "train", "train", "eval", "eval"]


def test_two_configs_of_one_name_are_refused(tmp_path, capsys, job):
    twin = tmp_path / "twin" / "debug_random.toml"
    twin.parent.mkdir()
    twin.write_text(Path(DEBUG).read_text())
    assert compare_drafts.main(["--minutes", "1", "--configs", f"{DEBUG},{twin}", "--out", str(tmp_path), *job]) == 2
    assert "same file name" in capsys.readouterr().err


def test_the_table_says_when_a_sampled_tau_came_from_point_mass_drafts(tmp_path):
    """tau at T > 0 is comparable across drafts only when each drew its drafts from its own q: a
    report whose drafts were point masses (or one too old to say) is named under the table."""
    meta = {"view": "recipes", "minutes": 6.0, "calibration_steps": 60, "prompts": "mtbench",
            "max_new_tokens": 256, "temperatures": [0.0, 1.0], "seed": 0, "date": "d"}
    rows = []
    for label, how in (("sampled", "q"), ("pointy", "point mass"), ("old", None)):
        folder = tmp_path / label
        folder.mkdir()
        rep = eval_report(1.0, [2], [5], [[1, 2]], None)
        if how is None:
            del rep["summary"]["draft_sampling"]
        else:
            for p in rep["prompts"]:
                p["sampled_rounds"] = p["rounds"] if how == "q" else 0
            rep["summary"]["draft_sampling"] = how
        (folder / eval_report_name(1.0, "float32")).write_text(json.dumps(rep))
        rows.append(build_row(str(folder), label, {"budget_min": 6.0}, [0.0, 1.0], None))
    assert [r["evals"]["1"]["draft_sampling"] for r in rows] == ["q", "point mass", "point mass"]
    note = [line for line in render_markdown(rows, meta).splitlines() if line.startswith("Drafts not drawn")]
    assert len(note) == 1 and "pointy (T=1: point mass), old (T=1: point mass)." in note[0]
    assert "sampled" not in note[0]
    assert not any(line.startswith("Drafts not drawn") for line in render_markdown(rows[:1], meta).splitlines())


def test_report_only_rebuilds_the_table_from_the_records_and_runs_nothing(tmp_path, monkeypatch, capsys, job):
    """Drafts compared one per machine: their folders gathered, --report-only writes the table of
    what is there, without the target or data (which stayed on those machines)."""
    jobs = FakeJobs()
    monkeypatch.setattr(compare_drafts, "run_logged", jobs)
    target = shutil.copytree(job[1], tmp_path / "target")
    job = ["--target", str(target), *job[2:]]
    assert _compare(tmp_path, job) == 0
    out = tmp_path / "out"
    table = (out / "table_recipes.md").read_text()
    (out / "table_recipes.md").unlink()
    jobs.calls.clear()
    shutil.rmtree(target)  # the target is not on this machine
    assert _compare(tmp_path, job, "--report-only") == 0 and jobs.calls == []
    assert (out / "table_recipes.md").read_text().split("| draft")[1] == table.split("| draft")[1]

    (out / "debug_random" / eval_report_name(1.0, "float32")).unlink()
    assert _compare(tmp_path, job, "--report-only") == 0 and jobs.calls == []
    assert "no eval_t1_float32.json" in capsys.readouterr().out
    row = json.loads((out / "table_recipes.json").read_text())["rows"][0]
    assert set(row["evals"]) == {"0"} and row["steps"] is not None
    assert not (out / "debug_random" / eval_report_name(1.0, "float32")).exists()  # nothing was run to make it

    # records of another comparison are refused, not mixed into the table
    assert _compare(tmp_path, job, "--report-only", "--margin", "0.1") == 2
    assert "planned for 1 min with margin 0.03" in capsys.readouterr().err
    assert _compare(tmp_path, job, "--report-only", "--lr_scheduler.warmup_steps", "3") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "made with another argv" in err and jobs.calls == []
