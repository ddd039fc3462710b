"""scripts/compare_drafts.py --training-seeds: each draft of the view trained once per seed (the
seed the only change, the same steps from one calibration), and the table's order of two drafts
called only where every pairing of their seeds is established on the prompts."""

from __future__ import annotations

import json
import os
import random

import pytest

from scripts import compare_drafts
from scripts.compare import runs as compare_runs
from titan_draft.decoding.tau_interval import across_seeds
from compare_fakes import FakeJobs, flat_config, prompt_report
from helpers import REPO

DFLASH2 = os.path.join(REPO, "train_configs", "debug_random.toml")
DSPARK = os.path.join(REPO, "train_configs", "dspark_debug.toml")


def _runs(argv: list[str]) -> dict[str, dict]:
    a, extra = compare_drafts.parse_args(argv)
    return {r["label"]: r for r in compare_runs.build_runs(a, extra, print)}


def test_each_seed_is_one_job_that_changes_only_the_training_seed(job):
    plain = _runs(["--minutes", "1", "--configs", f"{DFLASH2},{DSPARK}", *job])
    runs = _runs(["--minutes", "1", "--configs", f"{DFLASH2},{DSPARK}", "--training-seeds", "7,8", *job])
    assert list(runs) == ["debug_random-seed7", "debug_random-seed8", "dspark_debug-seed7", "dspark_debug-seed8"]
    for stem in ("debug_random", "dspark_debug"):
        base = flat_config(plain[stem]["cfg"])
        assert base["training.seed"] not in (7, 8)
        for seed in (7, 8):
            run = runs[f"{stem}-seed{seed}"]
            got = flat_config(run["cfg"])
            assert got["training.seed"] == seed and (run["group"], run["seed"]) == (stem, seed)
            assert {k for k in base if base[k] != got[k]} == {"training.seed"}, (stem, seed)
    # the ablation view: every job of the view, once per seed
    runs = _runs(["--minutes", "1", "--configs", DSPARK, "--view", "ablation", "--ablate", "optimizer.lr=3e-4",
                  "--training-seeds", "7,8", *job])
    assert {(r["group"], r["cfg"].training.seed, r["cfg"].optimizer.lr) for r in runs.values()} == {
        ("dspark_debug", 7, plain["dspark_debug"]["cfg"].optimizer.lr),
        ("dspark_debug", 8, plain["dspark_debug"]["cfg"].optimizer.lr),
        ("dspark_debug+optimizer.lr=3e-4", 7, 3e-4), ("dspark_debug+optimizer.lr=3e-4", 8, 3e-4)}


@pytest.mark.parametrize("args, expect", [
    (["--training-seeds", "7,x"], "--training-seeds '7,x': expected comma-separated integers"),
    (["--training-seeds", "7,7"], "--training-seeds '7,7': each seed once"),
    (["--training-seeds", "-1"], "each seed once, each >= 0"),
    (["--training-seeds", "7,8", "--training.seed", "3"], "--training.seed is set by --training-seeds"),
    (["--training-seeds", "7,8", "--view", "ablation", "--ablate", "training.seed=3"],
     "--ablate training.seed: with --training-seeds every job is trained once per seed"),
])
def test_bad_seed_requests_are_one_line_errors_before_any_job(tmp_path, capsys, monkeypatch, job, args, expect):
    jobs = FakeJobs()
    monkeypatch.setattr(compare_drafts, "run_logged", jobs)
    status = compare_drafts.main(["--minutes", "1", "--configs", DFLASH2, "--out", str(tmp_path), *job, *args])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and expect in err and jobs.calls == []


def _skills_report(skills: dict[str, float], difficulty: list[float]):
    """An eval report per run folder: (rounds, tokens) per prompt drawn from the run's skill."""
    def report_for(out_path: str, temperature: float) -> dict:
        label = os.path.basename(os.path.dirname(out_path))
        rng = random.Random(f"{label}-{temperature}")
        return prompt_report([(100, 100 + sum(rng.random() < skills[label] * d for _ in range(100)))
                              for d in difficulty])
    return report_for


def test_seeds_share_one_calibration_and_the_order_needs_every_pairing(tmp_path, monkeypatch, job):
    """DFlash2's two seeds both decode well; DSpark's seed 8 as well as them, its seed 7 worse. The
    means put DFlash2 first, but the seed-8 pairing is not established, so the order is not called."""
    rng = random.Random(0)
    difficulty = [rng.uniform(0.2, 1.0) for _ in range(40)]
    skills = {"debug_random-seed7": 0.9, "debug_random-seed8": 0.9, "dspark_debug-seed7": 0.5,
              "dspark_debug-seed8": 0.9}
    jobs = FakeJobs(report_for=_skills_report(skills, difficulty))
    monkeypatch.setattr(compare_drafts, "run_logged", jobs)
    out = tmp_path / "out"
    assert compare_drafts.main(["--minutes", "1", "--configs", f"{DFLASH2},{DSPARK}", "--out", str(out), *job,
                                "--calibration-steps", "6", "--calibration-warmup", "2", "--temperatures", "0",
                                "--training-seeds", "7,8"]) == 0
    # one calibration a draft; its seeds train the same steps, each with its own seed
    assert [k for k, _ in jobs.calls] == ["calibration", "train", "eval", "train", "eval"] * 2
    trains = [cmd for k, cmd in jobs.calls if k == "train"]
    arg = [dict(zip(cmd, cmd[1:])) for cmd in trains]
    assert [a["--training.seed"] for a in arg] == ["7", "8", "7", "8"]
    assert arg[0]["--training.steps"] == arg[1]["--training.steps"]
    assert arg[2]["--training.steps"] == arg[3]["--training.steps"]
    assert not (out / "debug_random-seed8" / "calibration.json").exists()

    table = json.loads((out / "table_recipes.json").read_text())
    assert table["paired"] == [] and len(table["across_seeds"]) == 1
    (entry,) = table["across_seeds"]
    assert entry["a"] == ["debug_random-seed7", "debug_random-seed8"]
    assert entry["b"] == ["dspark_debug-seed7", "dspark_debug-seed8"]
    reports = {label: json.loads((out / label / "eval_t0_float32.json").read_text())["prompts"] for label in skills}
    want = across_seeds([reports["debug_random-seed7"], reports["debug_random-seed8"]],
                        [reports["dspark_debug-seed7"], reports["dspark_debug-seed8"]])
    assert entry["mean"] == want["mean"] and entry["pairings"] == want["pairings"]
    assert entry["mean"]["established"] and not entry["established"] and entry["established_pairings"] == 2
    md = (out / "table_recipes.md").read_text()
    assert "Each draft trained once per training seed (7, 8), every seed the same steps." in md
    assert "## Across training seeds" in md and "| T | difference |" not in md
    assert "| 0 | debug_random-seed7 + debug_random-seed8 | dspark_debug-seed7 + dspark_debug-seed8 |" in md
    assert md.rstrip().endswith("| 2 of 4 |")

    # DSpark's seed 7 as good as the rest: every pairing is then level, none established
    skills["dspark_debug-seed7"] = 0.9
    for name in ("eval_t0_float32.json", "train.json"):
        (out / "dspark_debug-seed7" / name).unlink()
    jobs.calls.clear()
    assert compare_drafts.main(["--minutes", "1", "--configs", f"{DFLASH2},{DSPARK}", "--out", str(out), *job,
                                "--calibration-steps", "6", "--calibration-warmup", "2", "--temperatures", "0",
                                "--training-seeds", "7,8"]) == 0
    assert [k for k, _ in jobs.calls] == ["eval"]  # its export was there: read again, decoded again
    (entry,) = json.loads((out / "table_recipes.json").read_text())["across_seeds"]
    assert entry["established_pairings"] == 0 and not entry["mean"]["established"]
