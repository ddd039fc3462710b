"""scripts/compare_drafts.py end to end on CPU: the debug DFlash2 job against the random-weight
target, calibrated, trained for a tiny budget and decoded on two MT-Bench prompts at T = 0 and
T = 1, through the real trainer and eval CLI, once per training seed. The table's rows must be
what those jobs wrote, and the seeds the only difference between the two jobs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from scripts import compare_drafts
from titan_draft.checkpoint.export import exported_step
from helpers import REPO


@pytest.mark.slow
def test_compare_trains_for_the_budget_and_tabulates_the_runs(tmp_path, random_target_dir, chat_jsonl):
    out = tmp_path / "out"
    status = compare_drafts.main([
        "--configs", os.path.join(REPO, "train_configs", "debug_random.toml"), "--minutes", "0.25",
        "--target", random_target_dir, "--data", chat_jsonl, "--num-prompts", "2", "--max-new-tokens", "6",
        "--calibration-steps", "4", "--calibration-warmup", "1", "--launcher", "python", "--out", str(out),
        # a tiny step (one short row, two blocks) and no profiler: the overrides reach every job
        "--data.max_length", "32", "--training.local_batch_size", "1", "--model.args.num_anchors", "2",
        "--profiling.enable_profiling", "false", "--training-seeds", "1,2"])
    assert status == 0
    folder = out / "debug_random-seed1"
    row, row2 = json.loads((out / "table_recipes.json").read_text())["rows"]
    plan = json.loads((folder / "plan.json").read_text())
    # the second seed: the same steps from the first one's calibration, its own initialization
    assert (row2["label"], row2["steps"], row2["training_seed"]) == ("debug_random-seed2", plan["steps"], 2)
    assert not (out / "debug_random-seed2" / "calibration.json").exists()
    weights = [load_file(str(out / f"debug_random-seed{s}" / "run" / "export" / "model.safetensors")) for s in (1, 2)]
    assert weights[0].keys() == weights[1].keys()
    assert any(not torch.equal(weights[0][k], weights[1][k]) for k in weights[0])

    # the steps are the plan's, and the job ran exactly those: its export says so
    assert row["steps"] == plan["steps"] > 0
    assert exported_step(str(folder / "run" / "export")) == plan["steps"]
    # the lr schedule spans the chosen steps: the cosine reaches its floor at the last one
    events = EventAccumulator(str(folder / "run" / "tb" / "run"), size_guidance={"scalars": 0})
    events.Reload()
    lr = {e.step: e.value for e in events.Scalars("optim/lr")}
    assert max(lr) == plan["steps"] and lr[plan["steps"]] == pytest.approx(0.1 * 1e-2)  # min_lr_factor x lr
    attempts = json.loads((folder / "train_attempts.json").read_text())["wall_s"]
    assert row["training_min"] == pytest.approx(sum(attempts) / 60) and row["median_step_ms"] > 0
    assert row["peaks_gib"]["peak_rss_gib"] > 0

    for t in ("0", "1"):
        report = json.loads((folder / f"eval_t{t}_float32.json").read_text())["summary"]
        assert row["evals"][t]["tau"] == report["tau"] >= 1.0 and report["num_prompts"] == 2
        assert report["temperature"] == float(t)
    assert row["evals"]["0"]["lossless_prompts"] == 2  # fp32 greedy: token for token
    assert row["speed"]["ratio"] == pytest.approx(
        row["speed"]["speculative_tokens_per_s"] / row["speed"]["plain_tokens_per_s"])
    md = (out / "table_recipes.md").read_text()
    assert 0 < row["setup_s"] < 60 * row["training_min"]  # start-up and compile: part of the job, not all
    assert f"| debug_random-seed1 | 0.25 | {row['training_min']:.2f} | {row['setup_s']:.0f} | {plan['steps']} |" in md
    assert " | 2/2 | " in md
