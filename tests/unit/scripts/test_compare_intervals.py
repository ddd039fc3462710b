"""The comparison table's intervals: each tau's bootstrap interval over prompts, and the paired
differences it calls established or not (each draft against those below it in tau order; in the ablation view, each
changed setting against its recipe as it is)."""

from __future__ import annotations

import json
import random

from scripts.compare.report import build_row, eval_report_name, paired_comparisons, render_markdown, write_table
from titan_draft.decoding.tau_interval import paired_difference
from compare_fakes import prompt_report

META = {"view": "recipes", "minutes": 3.0, "calibration_steps": 60, "prompts": "mtbench", "max_new_tokens": 256,
        "temperatures": [0.0], "seed": 0, "date": "d"}


def _rows(tmp_path, reports: dict, infos: dict | None = None):
    rows = []
    for label, rep in reports.items():
        folder = tmp_path / label
        folder.mkdir()
        (folder / eval_report_name(0.0, "float32")).write_text(json.dumps(rep))
        info = {"budget_min": 3.0, **(infos or {}).get(label, {})}
        rows.append(build_row(str(folder), label, info, [0.0], None))
    return rows


def _prompts(rng, skill, difficulties):
    out = []
    for d in difficulties:
        rounds = 100
        out.append((rounds, rounds + sum(rng.random() < skill * d for _ in range(rounds))))
    return out


def test_every_draft_is_paired_with_those_below_it_and_called(tmp_path):
    rng = random.Random(0)
    difficulty = [rng.uniform(0.1, 1.0) for _ in range(40)]
    reports = {"dspark": prompt_report(_prompts(rng, 0.60, difficulty)),
               "eagle3": prompt_report(_prompts(rng, 0.90, difficulty)),
               "dflash2": prompt_report(_prompts(rng, 0.91, difficulty))}
    rows = _rows(tmp_path, reports)
    pairs = paired_comparisons(rows, "recipes")
    assert [(p["a"], p["b"]) for p in pairs] == [("dflash2", "eagle3"), ("dflash2", "dspark"), ("eagle3", "dspark")]
    for p in pairs:  # the same figures as pairing the reports directly
        want = paired_difference(reports[p["a"]]["prompts"], reports[p["b"]]["prompts"])
        assert {k: p[k] for k in want} == want
    assert pairs[2]["established"] and pairs[2]["low"] > 0 and pairs[1]["established"]
    assert not pairs[0]["established"] and pairs[0]["low"] < 0 < pairs[0]["high"]

    md = render_markdown(rows, META)
    assert "## How sure the order is" in md
    iv = rows[1]["evals"]["0"]["tau_interval"]
    assert f"| 0 | eagle3 | {iv['tau']:.3f} | {iv['low']:.3f} to {iv['high']:.3f} |" in md
    line = next(ln for ln in md.splitlines() if ln.startswith("| 0 | eagle3 − dspark |"))
    assert line.endswith("| established |") and f"{pairs[2]['difference']:+.3f}" in line
    assert next(ln for ln in md.splitlines() if ln.startswith("| 0 | dflash2 − eagle3 |")).endswith("| not established |")

    js = json.loads(open(write_table(str(tmp_path), rows, META)[1]).read())
    assert [(p["a"], p["b"], p["established"]) for p in js["paired"]] == [(p["a"], p["b"], p["established"]) for p in pairs]


def test_reports_on_other_prompts_are_named_not_paired(tmp_path):
    rng = random.Random(1)
    difficulty = [rng.uniform(0.1, 1.0) for _ in range(6)]
    other = [f"holdout:{i}" for i in range(6)]
    rows = _rows(tmp_path, {"a": prompt_report(_prompts(rng, 0.9, difficulty)),
                            "b": prompt_report(_prompts(rng, 0.5, difficulty), names=other)})
    (pair,) = paired_comparisons(rows, "recipes")
    assert "difference" not in pair and "holdout:0" in pair["not_paired"]
    assert "not paired: the two evals were not decoded on the same prompts" in render_markdown(rows, META)


def test_the_ablation_view_pairs_each_setting_with_its_recipe(tmp_path):
    rng = random.Random(2)
    difficulty = [rng.uniform(0.1, 1.0) for _ in range(30)]
    cfg = "train_configs/dspark_smollm2.toml"
    infos = {"dspark_smollm2": {"config": cfg, "view_overrides": []},
             "dspark_smollm2+markov_rank=64": {"config": cfg, "view_overrides": ["--model.args.markov_rank", "64"]},
             "dspark_smollm2+block_size=16": {"config": cfg, "view_overrides": ["--model.args.block_size", "16"]}}
    rows = _rows(tmp_path, {label: prompt_report(_prompts(rng, skill, difficulty))
                            for label, skill in zip(infos, (0.5, 0.9, 0.2))}, infos)
    pairs = paired_comparisons(rows, "ablation")
    assert [(p["a"], p["b"]) for p in pairs] == [("dspark_smollm2+markov_rank=64", "dspark_smollm2"),
                                                 ("dspark_smollm2+block_size=16", "dspark_smollm2")]
    assert pairs[0]["low"] > 0 and pairs[1]["high"] < 0  # one setting helps, the other hurts
