"""Learning-rate schedule: linear warm-up, then cosine / linear / constant decay.

The schedule is a ``LambdaLR`` whose factor depends only on the step count, so its state dict is
just ``last_epoch`` plus the base lrs and a resumed run continues on the exact same curve.

Step counting: the trainer calls ``optimizer.step()`` then ``lr_scheduler.step()``, so optimizer
step ``s`` (1-based) runs with the factor of ``last_epoch = s - 1``. We evaluate the curve at
``s``, which gives step 1 a nonzero lr (``1 / warmup``) and reaches the peak exactly at
``s = warmup`` and ``min_lr_factor`` exactly at ``s = total_steps``.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from titan_draft.config.job_config import LRScheduler as LRSchedulerConfig

logger = logging.getLogger(__name__)

_DECAY_TYPES = ("cosine", "linear", "constant")


def resolve_warmup_steps(cfg: LRSchedulerConfig, total_steps: int, *, warn: bool = True) -> int:
    """Warm-up length in optimizer steps (``warmup_steps``, or ``warmup_ratio`` of the total)."""
    if cfg.warmup_steps >= 0:
        warmup = cfg.warmup_steps
    else:
        if not 0.0 <= cfg.warmup_ratio <= 1.0:
            raise ValueError(
                f"lr_scheduler.warmup_ratio must be in [0, 1], got {cfg.warmup_ratio}"
            )
        warmup = int(cfg.warmup_ratio * total_steps)
    if warmup > total_steps and warn:
        # Common in smoke runs (--training.steps 5 over a recipe's TOML); training still works,
        # the peak lr is simply never reached, and the log says so.
        logger.warning(
            "lr_scheduler: warm-up (%d steps) is longer than the run (%d steps); "
            "the lr will not reach its peak",
            warmup,
            total_steps,
        )
    return warmup


def lr_factor_fn(
    warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float
) -> Callable[[int], float]:
    """Return ``f(last_epoch) -> lr / peak_lr`` (see the module docstring for step counting)."""
    decay_steps = max(1, total_steps - warmup_steps)

    def factor(last_epoch: int) -> float:
        step = last_epoch + 1
        if step <= warmup_steps:
            return step / warmup_steps
        if decay_type == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / decay_steps)
        if decay_type == "linear":
            decay = 1.0 - progress
        else:  # cosine
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return min_lr_factor + (1.0 - min_lr_factor) * decay

    return factor


class WarmupDecayLR(LambdaLR):
    """``LambdaLR`` whose ``load_state_dict`` also puts the restored lr into the optimizer.

    Plain ``LambdaLR`` restores only its own bookkeeping; the optimizer keeps the lr it was built
    with until the next ``step()``. Writing ``_last_lr`` back makes a scheduler-only restore exact
    too (a full checkpoint restores the same value through the optimizer's param groups).
    """

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        for group, lr in zip(self.optimizer.param_groups, self.get_last_lr()):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr


    def set_peak_lr(self, lr: float) -> None:
        """Rebase a restored schedule on the peak ``lr``: a load puts the saved base lrs back,
        while the curve (warm-up, decay, length) is always this job's, since it is rebuilt from
        the config and never restored. The next step's lr is then this job's curve at the
        resumed step."""
        self.base_lrs = [lr] * len(self.optimizer.param_groups)
        self._last_lr = [base * fn(self.last_epoch) for base, fn in zip(self.base_lrs, self.lr_lambdas)]
        for group, last in zip(self.optimizer.param_groups, self._last_lr):
            group["initial_lr"] = lr
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(last)
            else:
                group["lr"] = last


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: LRSchedulerConfig, total_steps: int
) -> WarmupDecayLR:
    """Build the warm-up + decay schedule for ``total_steps`` optimizer steps.

    ``constant`` keeps the peak lr after warm-up (``min_lr_factor`` is not used).
    """
    if cfg.decay_type not in _DECAY_TYPES:
        raise ValueError(
            f"unknown lr_scheduler.decay_type {cfg.decay_type!r}; "
            f"expected one of {', '.join(_DECAY_TYPES)}"
        )
    if not 0.0 <= cfg.min_lr_factor <= 1.0:
        raise ValueError(
            f"lr_scheduler.min_lr_factor must be in [0, 1], got {cfg.min_lr_factor}"
        )
    if total_steps < 1:
        raise ValueError(f"build_lr_scheduler: total_steps must be >= 1, got {total_steps}")
    warmup = resolve_warmup_steps(cfg, total_steps)
    fn = lr_factor_fn(warmup, total_steps, cfg.decay_type, cfg.min_lr_factor)
    logger.info(
        "lr schedule: %d warm-up steps, %s decay to %g x peak at step %d",
        warmup,
        cfg.decay_type,
        cfg.min_lr_factor if cfg.decay_type != "constant" else 1.0,
        total_steps,
    )
    # A closure (plain function) is not pickled into LambdaLR.state_dict(): the schedule is rebuilt
    # from config on resume and only the step count and lrs are restored.
    return WarmupDecayLR(optimizer, fn)
