"""scripts/compare_drafts.py --view ablation: the recipe as it is plus one job per ablated value,
each changing exactly its one key (or the keys of a joint change), and every malformed request refused in one line before a job."""

from __future__ import annotations

import os

import pytest

from scripts import compare_drafts
from scripts.compare import runs as compare_runs
from compare_fakes import flat_config
from helpers import REPO

DSPARK = os.path.join(REPO, "train_configs", "dspark_debug.toml")
DFLASH2 = os.path.join(REPO, "train_configs", "debug_random.toml")


def test_each_ablated_value_is_one_job_that_changes_only_its_key(job):
    argv = ["--minutes", "1", "--configs", f"{DSPARK},{DFLASH2}", "--view", "ablation",
            "--ablate", "model.args.num_anchors=4,16", "--ablate", "optimizer.lr=3e-4", *job]
    a, extra = compare_drafts.parse_args(argv)
    runs = {r["label"]: r for r in compare_runs.build_runs(a, extra, print)}
    want = {f"{stem}{suffix}" for stem in ("dspark_debug", "debug_random")
            for suffix in ("", "+num_anchors=4", "+num_anchors=16", "+optimizer.lr=3e-4")}
    assert set(runs) == want
    for stem in ("dspark_debug", "debug_random"):
        base = flat_config(runs[stem]["cfg"])
        for suffix, key, value in (("+num_anchors=4", "model.args.num_anchors", 4),
                                   ("+num_anchors=16", "model.args.num_anchors", 16),
                                   ("+optimizer.lr=3e-4", "optimizer.lr", 3e-4)):
            got = flat_config(runs[stem + suffix]["cfg"])
            assert got[key] == value, (stem, suffix)
            diff = {k for k in set(base) | set(got) if base.get(k) != got.get(k)}
            assert diff == {key}, (stem, suffix, diff)
            assert runs[stem + suffix]["view_args"] == [f"--{key}", str(value) if key != "optimizer.lr" else "3e-4"]


def test_a_joint_change_is_one_job_that_changes_its_keys_together(job):
    """A loss weight moved from one term to another changes two keys in one job; '+' inside a value
    (1e+3) is not a join."""
    argv = ["--minutes", "1", "--configs", DSPARK, "--view", "ablation",
            "--ablate", "model.args.ce_loss_weight=1.0+model.args.l1_loss_weight=0.0",
            "--ablate", "model.args.ce_loss_weight=0.5", "--ablate", "optimizer.lr=1e+3", *job]
    a, extra = compare_drafts.parse_args(argv)
    runs = {r["label"]: r for r in compare_runs.build_runs(a, extra, print)}
    joint = "dspark_debug+ce_loss_weight=1.0+l1_loss_weight=0.0"
    assert set(runs) == {"dspark_debug", joint, "dspark_debug+ce_loss_weight=0.5", "dspark_debug+optimizer.lr=1e+3"}
    base, got = flat_config(runs["dspark_debug"]["cfg"]), flat_config(runs[joint]["cfg"])
    assert {k for k in set(base) | set(got) if base.get(k) != got.get(k)} == {"model.args.ce_loss_weight",
                                                                             "model.args.l1_loss_weight"}
    assert (got["model.args.ce_loss_weight"], got["model.args.l1_loss_weight"]) == (1.0, 0.0)
    assert runs[joint]["view_args"] == ["--model.args.ce_loss_weight", "1.0", "--model.args.l1_loss_weight", "0.0"]
    assert flat_config(runs["dspark_debug+optimizer.lr=1e+3"]["cfg"])["optimizer.lr"] == 1e3


@pytest.mark.parametrize("args, expect", [
    (["--ablate", "optimizer.lr=1e-3"], "--ablate belongs to --view ablation, not recipes"),
    (["--view", "ablation"], "--view ablation needs at least one --ablate"),
    (["--view", "ablation", "--ablate", "lr=1e-3"], "expected KEY=V1[,V2...] with a dotted job-config key"),
    (["--view", "ablation", "--ablate", "optimizer.lr"], "expected KEY=V1[,V2...]"),
    (["--view", "ablation", "--ablate", "optimizer.lr=1e-3,"], "expected KEY=V1[,V2...]"),
    (["--view", "ablation", "--ablate", "training.steps=10"], "--ablate training.steps: set by the comparison"),
    (["--view", "ablation", "--ablate", "optimizer.lr=1e-3,1e-3"], "a key or value given twice"),
    (["--view", "ablation", "--ablate", "optimizer.lr=1e-3", "--ablate", "optimizer.lr=2e-3"],
     "a key or value given twice"),
    (["--view", "ablation", "--ablate", "optimizer.lr=1e-3", "--optimizer.lr", "2e-3"],
     "--optimizer.lr is both an override for every draft and an --ablate key"),
    (["--view", "ablation", "--ablate", "model.args.nope=1"], "model.args: unknown dflash2 arg(s) ['nope']"),
    (["--view", "ablation", "--ablate", "optimizer.lr=1e-3,2e-3+training.seed=1"],
     "each key of a joint change (KEY=V+KEY2=V2) takes one value"),
    (["--view", "ablation", "--ablate", "optimizer.lr=1e-3+optimizer.lr=2e-3"], "a key or value given twice"),
    (["--view", "ablation", "--ablate", "optimizer.lr=1e-3+training.seed=1", "--ablate",
      "training.seed=1+optimizer.lr=1e-3"], "the same change given twice"),
    (["--view", "ablation", "--ablate", "optimizer.lr=1e-3+training.steps=5"],
     "--ablate training.steps: set by the comparison"),
    (["--view", "ablation", "--ablate", "optimizer.lr=1e-3+training.seed=1", "--training.seed", "2"],
     "--training.seed is both an override for every draft and an --ablate key"),
])
def test_bad_ablations_are_one_line_errors_before_any_job(tmp_path, capsys, monkeypatch, job, args, expect):
    calls = []
    monkeypatch.setattr(compare_drafts, "run_logged", lambda *a, **k: calls.append(a) or (1, 0.0))
    status = compare_drafts.main(["--minutes", "1", "--configs", DFLASH2, "--out", str(tmp_path), *job, *args])
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and err.startswith("compare_drafts: error:"), err
    assert expect in err, err
    assert calls == []
