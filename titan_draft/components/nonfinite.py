"""The non-finite policy (``training.nonfinite``): no NaN or inf ever reaches the weights or a checkpoint.

Every optimizer step is checked once, after the global loss and the global gradient norm are
known and before the optimizer applies anything: both are already reduced over accumulation and
DP ranks, so every rank takes the same decision without another collective. The check is one
``isfinite`` on two scalars and one host sync per step (the optimizer step waits for the norm
anyway when clipping is on).

- ``stop``: raise :class:`NonFiniteError` before the update; the weights, the optimizer state and
  every checkpoint on disk are those of the last good step.
- ``skip``: drop the update (gradients cleared, no optimizer step) and go on; ``max_skips``
  non-finite steps in a row stop the run as ``stop`` does.

Weights can still become non-finite with finite gradients (an optimizer overflow), so a save is
refused when any parameter is not finite (:meth:`NonFiniteGuard.check_params`): a non-finite
checkpoint is never written, so ``checkpoint.keep_latest_k`` can never rotate the last good one
away in favour of a bad one.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

POLICIES = ("stop", "skip")
_NAMES_SHOWN = 3  # parameters named in the error line; the rest are counted


class NonFiniteError(RuntimeError):
    """The run stopped on a non-finite step or weight; the message is the one line to show."""


def _local(t: torch.Tensor) -> torch.Tensor:
    # DTensor shards (FSDP2) are checked locally: every rank checks its own rows
    return t.to_local() if isinstance(t, DTensor) else t


def _name_list(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


class NonFiniteGuard:
    """Decides, step by step, whether an update may be applied (see the module docstring).

    Args:
        policy: ``stop`` or ``skip``.
        max_skips: with ``skip``, this many non-finite steps in a row stop the run.
        model: the draft; its trainable parameters are named in the error lines.
        last_checkpoint: returns a phrase naming the newest checkpoint on disk (for the stop line).
    """

    def __init__(self, policy: str, max_skips: int, model: nn.Module,
                 last_checkpoint: Callable[[], str] = lambda: "no checkpoint was saved") -> None:
        if policy not in POLICIES:
            raise ValueError(f"training.nonfinite: {policy!r} must be one of {', '.join(POLICIES)}")
        if max_skips < 1:
            raise ValueError(f"training.nonfinite_max_skips: must be >= 1, got {max_skips}")
        self.policy = policy
        self.max_skips = max_skips
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.last_checkpoint = last_checkpoint
        self.in_a_row = 0
        self.skipped_steps: list[int] = []

    def _bad_grads(self) -> list[str]:
        return [n for n, p in self.named_params
                if p.grad is not None and not bool(torch.isfinite(_local(p.grad)).all())]

    def allow_update(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> bool:
        """True: apply this step's update. False: skip it (policy ``skip``). Raises
        :class:`NonFiniteError` when the run must stop. ``loss_sum`` and ``grad_norm`` are the
        global (all-reduced) values."""
        finite = torch.isfinite(torch.stack([loss_sum.double(), grad_norm.detach().double().reshape(())]))
        loss_ok, norm_ok = finite.tolist()
        if loss_ok and norm_ok:
            self.in_a_row = 0
            return True
        parts = []
        if not loss_ok:
            parts.append(f"the loss is {float(loss_sum)}")
        if not norm_ok:
            parts.append(f"the gradient norm is {float(grad_norm)}")
        bad = self._bad_grads()
        if bad:
            rank = f" on rank {dist.get_rank()}" if dist.is_initialized() else ""
            parts.append(f"non-finite gradients{rank} in {_name_list(bad)}")
        what = f"step {step}: " + ", ".join(parts)
        self.in_a_row += 1
        if self.policy == "skip" and self.in_a_row < self.max_skips:
            self.skipped_steps.append(step)
            logger.warning("training: %s; update skipped (training.nonfinite = skip, %d of %d in a row)",
                           what, self.in_a_row, self.max_skips)
            return False
        why = ("training.nonfinite = stop" if self.policy == "stop"
               else f"{self.in_a_row} non-finite steps in a row, training.nonfinite_max_skips = {self.max_skips}")
        raise NonFiniteError(f"training: {what}; stopped ({why}) before applying it: nothing of this "
                             f"step was applied or saved, {self.last_checkpoint()}")

    def check_params(self, step: int) -> None:
        """Raise :class:`NonFiniteError` instead of saving weights that are not all finite.
        Collective when distributed (every rank calls it before a save)."""
        bad = [n for n, p in self.named_params if not bool(torch.isfinite(_local(p.detach())).all())]
        flag = torch.tensor([float(len(bad))], device=self.named_params[0][1].device if self.named_params else "cpu")
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag)
        if flag.item() == 0:
            return
        where = f"non-finite weights in {_name_list(bad)}" if bad else "non-finite weights on another rank"
        raise NonFiniteError(f"training: step {step}: {where}; the checkpoint of this step was not "
                             f"written, {self.last_checkpoint()}")


def build_nonfinite_guard(training_cfg, model: nn.Module,
                          last_checkpoint: Callable[[], str] | None = None) -> NonFiniteGuard:
    """The guard of the ``[training]`` section's non-finite policy."""
    kw = {"last_checkpoint": last_checkpoint} if last_checkpoint is not None else {}
    return NonFiniteGuard(training_cfg.nonfinite, training_cfg.nonfinite_max_skips, model, **kw)
