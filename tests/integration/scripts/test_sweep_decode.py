"""scripts/sweep_decode.py: every setting of the grid decoded by the real eval against one export,
the plain greedy decodes made once and shared, and bad input refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, job_args, run_training

SCRIPT = os.path.join(REPO, "scripts", "sweep_decode.py")
SMALL = ("--prompts", "mtbench", "--num-prompts", "2", "--max-new-tokens", "6", "--dtype", "float32")


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, chat_jsonl, random_target_dir):
    dump = tmp_path_factory.mktemp("sweep_decode")
    run_training(job_args(dump, chat_jsonl, random_target_dir, "--training.steps", "1"))
    return str(dump / "export")


def _sweep(target, export, out, *extra):
    return subprocess.run([sys.executable, SCRIPT, "--target", target, "--draft", export, *SMALL, "--out", str(out),
                           *extra], cwd=REPO, capture_output=True, text=True, timeout=600)


def test_each_setting_is_decoded_and_the_plain_decodes_shared(export_dir, random_target_dir, tmp_path):
    proc = _sweep(random_target_dir, export_dir, tmp_path, "--option", "graph_commit=false,true")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [r["setting"] for r in rows] == ["defaults", "graph_commit=false", "graph_commit=true"]
    # the same proposals whichever commit: the same tau; plain greedy decoded by the first eval only
    assert len({r["tau"] for r in rows}) == 1 and all(r["lossless"] == "2/2" for r in rows)
    assert [r["plain_from_cache"] for r in rows] == [0, 2, 2]
    for i, r in enumerate(rows):
        report = json.loads((tmp_path / f"setting_{i}.json").read_text())
        assert report["proposer_options"] == ({} if i == 0 else {"graph_commit": i == 2})
        assert r["speculative_tokens_per_s"] == report["summary"]["speculative_tokens_per_s"]
    table = (tmp_path / "sweep.md").read_text()
    assert all(f"| {r['setting']} | {r['tau']:.3f} |" in table for r in rows)


@pytest.mark.parametrize("extra,want", [
    (("--option", "graph_commit"), "--option 'graph_commit': expected KEY=V1[,V2...]"),
    (("--option", "graph_commit=true", "--option", "graph_commit=false"), "--option graph_commit: given twice"),
    # the bad value in the last setting: refused before the first one is decoded
    (("--option", "graph_commit=true,False"), "graph_commit=False: --proposer-option "
                                              "graph_commit='False': draft 'dflash2' takes bool or null there"),
    (("--option", "num_draft_tokens=3"), "num_draft_tokens=3: --proposer-option: draft 'dflash2' does not take "
                                         "['num_draft_tokens'] (it takes ['max_len', 'graphs', 'graph_commit', "
                                         "'outside_candidates'])"),
])
def test_bad_input_is_refused_in_one_line(export_dir, random_target_dir, tmp_path, extra, want):
    proc = _sweep(random_target_dir, export_dir, tmp_path, *extra)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"sweep_decode: error: {want}"), proc.stderr
    assert not list(tmp_path.glob("setting_*")), "an eval ran before the request was checked"
