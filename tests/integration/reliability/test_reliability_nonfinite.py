"""training.nonfinite: a NaN/inf step never reaches the weights, a checkpoint or the export."""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch import nn

from titan_draft.components.nonfinite import NonFiniteError, NonFiniteGuard
from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import Trainer
from helpers import job_args, poison_features, weights


def _trainer(tmp_path, chat_jsonl, random_target_dir, *extra):
    return Trainer(ConfigManager().parse_args(job_args(tmp_path, chat_jsonl, random_target_dir, *extra)))


def test_stop_keeps_the_last_good_checkpoint_and_exports_nothing(tmp_path, chat_jsonl, random_target_dir, monkeypatch):
    trainer = _trainer(tmp_path, chat_jsonl, random_target_dir, "--training.steps", "6",
                       "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "1")
    poison_features(monkeypatch, trainer, {5, 6})
    saved = {}
    real_save = trainer.checkpointer.save
    trainer.checkpointer.save = lambda step, **kw: (saved.__setitem__(step, weights(trainer)), real_save(step, **kw))[1]
    try:
        with pytest.raises(NonFiniteError) as err:
            trainer.train()
        after = weights(trainer)
    finally:
        trainer.close()
        destroy_distributed()
    line = str(err.value)
    assert "step 5" in line and "the loss is nan" in line and "training.nonfinite = stop" in line, line
    assert str(tmp_path / "checkpoint" / "step-4") in line and "\n" not in line
    # keep_latest_k = 1 rotated only finite checkpoints: step-4 is what is left, nothing after it
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-4"]
    assert not (tmp_path / "export").exists()
    # nothing of step 5 was applied: the weights are step 4's
    for name, w in saved[4].items():
        assert torch.equal(after[name], w), name


def test_skip_drops_the_update_then_trains_on(tmp_path, chat_jsonl, random_target_dir, monkeypatch):
    trainer = _trainer(tmp_path, chat_jsonl, random_target_dir, "--training.steps", "5",
                       "--training.nonfinite", "skip", "--training.nonfinite_max_skips", "2",
                       "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "0")
    poison_features(monkeypatch, trainer, {3})
    saved = {}
    real_save = trainer.checkpointer.save
    trainer.checkpointer.save = lambda step, **kw: (saved.__setitem__(step, weights(trainer)), real_save(step, **kw))[1]
    try:
        losses = trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    assert math.isnan(losses[3]) and all(math.isfinite(losses[s]) for s in (1, 2, 4, 5))
    assert trainer.nonfinite.skipped_steps == [3]
    for name, w in saved[2].items():
        assert torch.equal(saved[3][name], w), name  # step 3 changed nothing
        assert torch.isfinite(saved[5][name]).all()
    assert any(not torch.equal(saved[4][n], w) for n, w in saved[3].items())  # step 4 trained again
    assert (tmp_path / "export" / "model.safetensors").exists()


def test_skip_stops_after_max_skips_in_a_row(tmp_path, chat_jsonl, random_target_dir, monkeypatch):
    trainer = _trainer(tmp_path, chat_jsonl, random_target_dir, "--training.steps", "6",
                       "--training.nonfinite", "skip", "--training.nonfinite_max_skips", "2",
                       "--checkpoint.interval", "2")
    poison_features(monkeypatch, trainer, {3, 4})
    try:
        with pytest.raises(NonFiniteError, match=r"step 4: .*2 non-finite steps in a row"):
            trainer.train()
    finally:
        trainer.close()
        destroy_distributed()
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2"]


def test_guard_names_the_non_finite_gradients_and_refuses_non_finite_weights():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    guard = NonFiniteGuard("stop", 1, model, last_checkpoint=lambda: "the last good checkpoint is X")
    model(torch.ones(2, 3)).sum().backward()
    assert guard.allow_update(1, torch.tensor(1.0, dtype=torch.float64), torch.tensor(2.0))
    model[1].weight.grad[0, 1] = float("inf")
    with pytest.raises(NonFiniteError, match=r"step 7: the gradient norm is inf, non-finite gradients in 1\.weight;"):
        guard.allow_update(7, torch.tensor(1.0, dtype=torch.float64), torch.tensor(float("inf")))
    guard.check_params(8)  # finite weights: nothing to say
    with torch.no_grad():
        model[0].bias[2] = float("nan")
    with pytest.raises(NonFiniteError, match=r"step 9: non-finite weights in 0\.bias; .*last good checkpoint is X"):
        guard.check_params(9)
    with pytest.raises(ValueError, match="training.nonfinite"):
        NonFiniteGuard("ignore", 1, model)
