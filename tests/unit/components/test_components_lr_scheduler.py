"""LR schedule: warm-up and decay values against the closed form; exact state-dict restore."""

import math

import pytest
import torch
from torch import nn

from titan_draft.components.lr_scheduler import build_lr_scheduler, resolve_warmup_steps
from titan_draft.config.job_config import LRScheduler


def _lrs_used(cfg: LRScheduler, total: int, peak: float = 1.0) -> list[float]:
    """lr the optimizer applies at steps 1..total (step, then scheduler step, as the trainer does)."""
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=peak)
    sched = build_lr_scheduler(opt, cfg, total)
    used = []
    for _ in range(total):
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return used


def test_warmup_then_cosine_matches_closed_form():
    warmup, total, floor = 4, 20, 0.1
    used = _lrs_used(LRScheduler(warmup_steps=warmup, decay_type="cosine", min_lr_factor=floor), total)

    def expected(s: int) -> float:
        if s <= warmup:
            return s / warmup
        p = (s - warmup) / (total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))

    for s in range(1, total + 1):
        assert used[s - 1] == pytest.approx(expected(s), abs=1e-12), s
    assert used[0] == pytest.approx(0.25)  # step 1 already trains
    assert used[warmup - 1] == pytest.approx(1.0)  # peak at the end of warm-up
    assert used[12 - 1] == pytest.approx(floor + (1 - floor) * 0.5)  # cosine midpoint
    assert used[total - 1] == pytest.approx(floor)  # min lr at the last step


def test_linear_and_constant_decay():
    lin = _lrs_used(LRScheduler(warmup_steps=2, decay_type="linear", min_lr_factor=0.0), 10)
    assert lin[:2] == pytest.approx([0.5, 1.0])
    assert lin[5] == pytest.approx(1 - (6 - 2) / 8)
    assert lin[-1] == pytest.approx(0.0)
    const = _lrs_used(LRScheduler(warmup_steps=2, decay_type="constant", min_lr_factor=0.3), 10)
    assert const == pytest.approx([0.5] + [1.0] * 9)


def test_warmup_ratio_and_bad_config():
    assert resolve_warmup_steps(LRScheduler(warmup_steps=-1, warmup_ratio=0.1), 55) == 5
    assert resolve_warmup_steps(LRScheduler(warmup_steps=7), 55) == 7
    no_warmup = _lrs_used(LRScheduler(warmup_steps=0, decay_type="linear"), 4)
    assert no_warmup == pytest.approx([0.75, 0.5, 0.25, 0.0])
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1.0)
    with pytest.raises(ValueError, match="lr_scheduler.decay_type"):
        build_lr_scheduler(opt, LRScheduler(decay_type="exp"), 10)


def test_state_dict_restores_exact_lr():
    cfg = LRScheduler(warmup_steps=3, decay_type="cosine", min_lr_factor=0.05)
    total = 30

    def make():
        opt = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=6e-4)
        return opt, build_lr_scheduler(opt, cfg, total)

    opt, sched = make()
    for _ in range(11):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2, sched2 = make()
    sched2.load_state_dict(state)  # scheduler alone, no optimizer state
    assert sched2.get_last_lr() == sched.get_last_lr()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    for _ in range(10):
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
        assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
