"""The resume guard of the optimizer and the lr schedule: a resume under other settings is refused
naming the keys, or, with checkpoint.apply_new_optimizer_settings, trains on with this job's
values (checked against AdamW and the schedule written out here); incomplete step folders are
removed, complete ones kept."""

from __future__ import annotations

import logging
import math
import os
import shutil
from types import SimpleNamespace

import pytest
import torch
from test_components_checkpoint import Draft, FakeLoader

from titan_draft.checkpoint.integrity import verify_checkpoint
from titan_draft.checkpoint.manager import CheckpointManager, TrainState
from titan_draft.checkpoint.resume_guard import OPTIMIZER_KEYS, ResumeRefusedError, build_optimizer_keys
from titan_draft.components.lr_scheduler import build_lr_scheduler
from titan_draft.components.optimizer import build_optimizer
from titan_draft.config.job_config import Checkpoint, LRScheduler, Optimizer

SAVED = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01)
NEW = dict(lr=3e-3, beta1=0.5, beta2=0.9, eps=1e-3, weight_decay=0.2)


def _job(opt: dict, warmup: int, steps: int, seed: int = 0, implementation: str = "foreach"):
    """A draft, its AdamW and schedule, and the job's optimizer keys."""
    o = Optimizer(**opt, implementation=implementation)
    s = LRScheduler(warmup_steps=warmup, decay_type="cosine", min_lr_factor=0.1)
    torch.manual_seed(seed)
    model = Draft()
    optimizer = build_optimizer(model, o, "cpu")
    sched = build_lr_scheduler(optimizer, s, steps)
    keys = build_optimizer_keys(SimpleNamespace(optimizer=o, lr_scheduler=s), "cpu", steps)
    return SimpleNamespace(model=model, opt=optimizer, sched=sched, keys=keys)


def _manager(root, job, ckpt: Checkpoint | None = None) -> CheckpointManager:
    return CheckpointManager(ckpt or Checkpoint(interval=2), str(root), model=job.model, optimizer=job.opt,
                             lr_scheduler=job.sched, dataloader=FakeLoader(), train_state=TrainState(),
                             dp_rank=0, dp_world=1, optimizer_keys=job.keys)


def _grads(job, step: int) -> None:
    job.opt.zero_grad()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + step))
    job.model(x).pow(2).mean().backward()


def _train(job, steps: range) -> None:
    for step in steps:
        _grads(job, step)
        job.opt.step()
        job.sched.step()


def _lr(peak: float, step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Warm-up then cosine to ``floor`` x peak, at optimizer step ``step`` (1-based)."""
    if step <= warmup:
        return peak * step / warmup
    progress = (step - warmup) / (total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def _adamw(p, g, m, v, t, lr, beta1, beta2, eps, weight_decay):
    """One AdamW step in float64 (decoupled decay, bias-corrected moments)."""
    p, g, m, v = (x.double() for x in (p, g, m, v))
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p * (1 - lr * weight_decay)
    return p - lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)


def test_other_optimizer_settings_are_refused_naming_the_keys(tmp_path):
    saved = _job(SAVED, warmup=2, steps=20)
    _train(saved, range(1, 5))
    assert _manager(tmp_path, saved).save(4)
    fresh = _job({**SAVED, "lr": 1e6, "beta1": 0.5}, warmup=2, steps=40, seed=1)
    before = {n: p.detach().clone() for n, p in fresh.model.named_parameters()}
    with pytest.raises(ResumeRefusedError, match=r"step-4: this job changes the optimizer or lr schedule it was saved "
                       r"with \(optimizer.lr 0.01 -> 1000000.0, optimizer.beta1 0.9 -> 0.5, training.steps 20 -> 40\); "
                       r"resume with the saved values, or set checkpoint.apply_new_optimizer_settings = true"):
        _manager(tmp_path, fresh).load()
    # refused before anything was read into the model
    assert all(torch.equal(p, before[n]) for n, p in fresh.model.named_parameters())
    # the same settings resume without a word
    same = _job(SAVED, warmup=2, steps=20, seed=1)
    assert _manager(tmp_path, same).load() == 4


def test_the_flag_applies_the_new_settings_to_the_restored_optimizer_and_schedule(tmp_path, caplog):
    saved = _job(SAVED, warmup=2, steps=20)
    _train(saved, range(1, 5))
    assert _manager(tmp_path, saved).save(4)

    new = _job(NEW, warmup=6, steps=30, seed=1)
    with caplog.at_level(logging.WARNING):
        assert _manager(tmp_path, new, Checkpoint(apply_new_optimizer_settings=True)).load() == 4
    lines = [r.getMessage() for r in caplog.records if "apply_new_optimizer_settings" in r.getMessage()]
    assert "checkpoint: checkpoint.apply_new_optimizer_settings: optimizer.lr 0.01 -> 0.003" in lines
    assert "checkpoint: checkpoint.apply_new_optimizer_settings: optimizer.weight_decay 0.01 -> 0.2" in lines
    assert "checkpoint: checkpoint.apply_new_optimizer_settings: lr_scheduler.warmup_steps 2 -> 6" in lines
    assert "checkpoint: checkpoint.apply_new_optimizer_settings: training.steps 20 -> 30" in lines
    assert len(lines) == 8  # lr, beta1, beta2, eps, weight_decay, warm-up, steps: one line each; then the lr line

    # the moments and step count are the saved run's; the settings are this job's
    for p_saved, p_new in zip(saved.model.parameters(), new.model.parameters()):
        assert torch.equal(p_saved, p_new)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved.opt.state[p_saved][key], new.opt.state[p_new][key])
    group = new.opt.param_groups[0]
    assert (group["betas"], group["eps"], group["weight_decay"]) == ((0.5, 0.9), 1e-3, 0.2)

    # the next steps run at this job's curve at the resumed step, with this job's AdamW
    for step in (5, 6, 7):
        lr = _lr(NEW["lr"], step, warmup=6, total=30)
        assert group["lr"] == pytest.approx(lr, rel=1e-12)
        _grads(new, step)
        params = list(new.model.parameters())
        expected = [_adamw(p.detach(), p.grad, new.opt.state[p]["exp_avg"], new.opt.state[p]["exp_avg_sq"],
                           float(new.opt.state[p]["step"]) + 1, lr, **{k: NEW[k] for k in NEW if k != "lr"})
                    for p in params]
        old_rule = _adamw(params[0].detach(), params[0].grad, new.opt.state[params[0]]["exp_avg"],
                          new.opt.state[params[0]]["exp_avg_sq"], float(new.opt.state[params[0]]["step"]) + 1,
                          _lr(SAVED["lr"], step, warmup=2, total=20), **{k: SAVED[k] for k in SAVED if k != "lr"})
        new.opt.step()
        new.sched.step()
        for p, want in zip(params, expected):
            torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(params[0].detach().double(), old_rule, rtol=1e-5, atol=1e-6)

    # the next checkpoint records the applied settings, so the resume after it needs no flag
    assert _manager(tmp_path, new).save(8)
    again = _job(NEW, warmup=6, steps=30, seed=2)
    assert _manager(tmp_path, again).load() == 8


@pytest.mark.parametrize("saved_kernel,new_kernel", [("fused", "for-loop"), ("foreach", "fused")])
def test_another_adamw_kernel_is_refused_or_applied(tmp_path, saved_kernel, new_kernel):
    saved = _job(SAVED, warmup=2, steps=20, implementation=saved_kernel)
    _train(saved, range(1, 3))
    assert _manager(tmp_path, saved).save(2)
    with pytest.raises(ResumeRefusedError, match=rf'\(optimizer.implementation "{saved_kernel}" -> "{new_kernel}"\)'):
        _manager(tmp_path, _job(SAVED, warmup=2, steps=20, seed=1, implementation=new_kernel)).load()
    new = _job(NEW, warmup=2, steps=20, seed=1, implementation=new_kernel)
    assert _manager(tmp_path, new, Checkpoint(apply_new_optimizer_settings=True)).load() == 2
    group = new.opt.param_groups[0]
    assert (group["fused"], group["foreach"]) == (new_kernel == "fused", new_kernel == "foreach")
    for step in (3, 4):
        _grads(new, step)
        params = list(new.model.parameters())
        expected = [_adamw(p.detach(), p.grad, new.opt.state[p]["exp_avg"], new.opt.state[p]["exp_avg_sq"],
                           float(new.opt.state[p]["step"]) + 1, _lr(NEW["lr"], step, warmup=2, total=20),
                           **{k: NEW[k] for k in NEW if k != "lr"}) for p in params]
        new.opt.step()
        new.sched.step()
        for p, want in zip(params, expected):
            torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_without_recorded_settings_is_said_and_the_flag_still_applies(tmp_path, caplog):
    saved = _job(SAVED, warmup=2, steps=20)
    _train(saved, range(1, 3))
    _manager(tmp_path, saved).save(2)
    os.remove(tmp_path / "checkpoint" / "step-2" / OPTIMIZER_KEYS)  # what an older version saved
    os.remove(tmp_path / "checkpoint" / "step-2" / "integrity.json")
    new = _job(NEW, warmup=2, steps=20, seed=1)
    with caplog.at_level(logging.WARNING):
        assert _manager(tmp_path, new, Checkpoint(apply_new_optimizer_settings=True)).load() == 2
    assert f"has no {OPTIMIZER_KEYS}" in caplog.text and "this job's are applied" in caplog.text
    assert new.opt.param_groups[0]["weight_decay"] == 0.2
    assert new.opt.param_groups[0]["lr"] == pytest.approx(_lr(NEW["lr"], 3, warmup=2, total=20))


def test_incomplete_step_folders_are_removed_and_complete_ones_kept(tmp_path, caplog):
    job = _job(SAVED, warmup=2, steps=20)
    _train(job, range(1, 3))
    mgr = _manager(tmp_path, job)
    assert mgr.save(2)
    root = tmp_path / "checkpoint"
    shutil.copytree(root / "step-2", root / "step-4")  # a save killed before DCP's .metadata
    os.remove(root / "step-4" / ".metadata")
    os.makedirs(root / "step-6")  # killed before DCP wrote anything
    (root / "step-6" / OPTIMIZER_KEYS).write_text("{}")
    os.makedirs(root / "notes")
    before = sorted(os.listdir(root / "step-2"))

    # checkpoint.folder outside the dump folder: no run lock covers it, so nothing is touched
    outside = _manager(tmp_path / "other_dump", job, Checkpoint(folder=str(root)))
    assert outside.remove_incomplete() == [] and (root / "step-4").is_dir()
    # checkpointing off: the folder is not this run's business
    assert _manager(tmp_path, job, Checkpoint(enable=False)).remove_incomplete() == []

    with caplog.at_level(logging.INFO):
        removed = mgr.remove_incomplete()
    assert removed == [str(root / "step-4"), str(root / "step-6")]
    assert sorted(os.listdir(root)) == ["notes", "step-2"]
    assert sorted(os.listdir(root / "step-2")) == before and verify_checkpoint(str(root / "step-2")) is None
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("checkpoint: removed"))
    assert line == (f"checkpoint: removed incomplete checkpoint folder(s) left by an interrupted save: "
                    f"{root / 'step-4'}, {root / 'step-6'}")
    assert mgr.remove_incomplete() == []
