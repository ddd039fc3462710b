"""scripts/compare_drafts.py on one GPU (skipped without CUDA): two debug drafts against the
random-weight target through ./run_train.sh, a one-minute budget each, the bf16 speed eval. On a
GPU the plan must hold: each job ends within its budget, its peak memory is CUDA's, and the speed
columns come from the bf16 report."""

from __future__ import annotations

import json
import os

import pytest
import torch

from scripts import compare_drafts
from helpers import REPO

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_compare_on_a_gpu_keeps_the_budget(tmp_path, random_target_dir, chat_jsonl, monkeypatch):
    monkeypatch.setenv("NGPU", "1")
    configs = ",".join(os.path.join(REPO, "train_configs", n) for n in ("debug_random.toml", "dspark_debug.toml"))
    out = tmp_path / "out"
    status = compare_drafts.main([
        "--configs", configs, "--minutes", "1", "--target", random_target_dir, "--data", chat_jsonl,
        "--num-prompts", "2", "--max-new-tokens", "16", "--speed-dtype", "bfloat16",
        "--calibration-steps", "30", "--calibration-warmup", "5", "--out", str(out),
        "--data.max_length", "128", "--profiling.enable_profiling", "false"])
    assert status == 0
    rows = {r["label"]: r for r in json.loads((out / "table_recipes.json").read_text())["rows"]}
    assert set(rows) == {"debug_random", "dspark_debug"}
    for label, row in rows.items():
        plan = json.loads((out / label / "plan.json").read_text())
        assert row["steps"] == plan["steps"] > 30, label  # a minute holds more than the calibration
        # the job, start to exit, within its budget (the margin is 3 %; a little more for a busy host)
        assert row["training_min"] <= 1.02, (label, row["training_min"], plan)
        peaks = row["peaks_gib"]
        assert 0 < peaks["max_allocated_gib"] <= peaks["max_reserved_gib"], (label, peaks)
        speed = json.loads((out / label / "eval_t0_bfloat16.json").read_text())["summary"]
        assert row["speed"]["dtype"] == "bfloat16"
        assert row["speed"]["speculative_tokens_per_s"] == speed["speculative_tokens_per_s"] > 0
        assert row["evals"]["0"]["lossless_prompts"] == 2 and row["evals"]["0"]["tau"] >= 1.0
