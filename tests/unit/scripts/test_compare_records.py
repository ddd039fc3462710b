"""scripts/compare_drafts.py's records read the same on every checkout: a comparison's folders
gathered from a machine whose repository lies elsewhere are the same comparison there (resumed,
or tabulated with --report-only), not refused as another one."""

from __future__ import annotations

import json
import os
import shutil


from scripts import compare_drafts
from scripts.compare import jobs as compare_jobs
from compare_fakes import FakeJobs
from helpers import REPO

DEBUG = os.path.join(REPO, "train_configs", "debug_random.toml")


def test_folders_gathered_from_another_checkout_are_the_same_comparison(tmp_path, monkeypatch, capsys, job):
    jobs = FakeJobs()
    monkeypatch.setattr(compare_drafts, "run_logged", jobs)
    for checkout in ("a", "b"):
        os.makedirs(tmp_path / checkout / "train_configs")
        shutil.copy(DEBUG, tmp_path / checkout / "train_configs")

    def compare(checkout: str, *extra: str) -> int:
        monkeypatch.setattr(compare_jobs, "REPO", str(tmp_path / checkout))
        recipe = tmp_path / checkout / "train_configs" / "debug_random.toml"
        out = tmp_path / checkout / "out"
        return compare_drafts.main(["--minutes", "1", "--configs", str(recipe), "--out", str(out), *job,
                                    "--calibration-steps", "6", "--calibration-warmup", "2", *extra])

    assert compare("a") == 0 and [k for k, _ in jobs.calls] == ["calibration", "train", "eval", "eval"]
    settings = tmp_path / "b" / "out" / "debug_random" / "settings.json"
    shutil.copytree(tmp_path / "a" / "out", tmp_path / "b" / "out")
    recorded = json.loads(settings.read_text())
    # the recipe inside the checkout is recorded relative to it; the target outside it as given
    assert "train_configs/debug_random.toml" in recorded["argv"] and job[1] in recorded["argv"]
    assert json.loads((tmp_path / "a" / "out" / "debug_random" / "eval_settings.json").read_text())["target"] == job[1]

    jobs.calls.clear()
    assert compare("b") == 0 and jobs.calls == []  # every stage done: nothing runs again, no eval is redone
    table = (tmp_path / "b" / "out" / "table_recipes.md").read_text()
    assert compare("b", "--report-only") == 0 and jobs.calls == []
    assert (tmp_path / "b" / "out" / "table_recipes.md").read_text().split("| draft")[1] == table.split("| draft")[1]

    # a record of this checkout's absolute paths (as written before records were portable) is the same comparison
    recorded["argv"] = [str(tmp_path / "b" / v) if v == "train_configs/debug_random.toml" else v
                        for v in recorded["argv"]]
    settings.write_text(json.dumps(recorded))
    assert compare("b") == 0 and jobs.calls == []
    # a path of another checkout that is not this one's is another comparison still
    recorded["argv"] = [str(tmp_path / "a" / "train_configs" / "debug_random.toml") if v.endswith("debug_random.toml")
                        else v for v in recorded["argv"]]
    settings.write_text(json.dumps(recorded))
    capsys.readouterr()
    assert compare("b") == 2 and jobs.calls == []
    assert "made with another argv" in capsys.readouterr().err
