"""Optimizer construction from the [optimizer] config section.

Only AdamW is offered: every draft in this project trains with it, and a second optimizer would be
dead code until a recipe needs it. Parameters may be plain tensors or FSDP2 DTensors; both the
fused and the foreach AdamW kernels accept DTensors, so nothing here depends on the parallelism.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from titan_draft.config.job_config import Optimizer as OptimizerConfig

logger = logging.getLogger(__name__)

_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")


def resolve_implementation(implementation: str, device_type: str) -> str:
    """The AdamW kernel ``optimizer.implementation`` stands for on ``device_type``."""
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(
            f"unknown optimizer.implementation {implementation!r}; "
            f"expected one of {', '.join(_IMPLEMENTATIONS)}"
        )
    if implementation == "auto":
        # fused is the fastest on CUDA (one kernel for all params); on CPU foreach is the
        # well-trodden path and the fused CPU kernel gains little for draft-sized models.
        return "fused" if device_type == "cuda" else "foreach"
    return implementation


def _implementation_kwargs(implementation: str, device_type: str) -> dict[str, bool]:
    """Map optimizer.implementation to AdamW's ``fused`` / ``foreach`` flags."""
    resolved = resolve_implementation(implementation, device_type)
    return {"fused": resolved == "fused", "foreach": resolved == "foreach"}


def apply_optimizer_settings(optimizer: torch.optim.Optimizer, *, betas: tuple[float, float], eps: float,
                             weight_decay: float, implementation: str) -> None:
    """Put this job's AdamW settings into an optimizer whose state was just restored: a load
    replaces the param groups with the saved ones, settings included. The lr is the schedule's
    (``WarmupDecayLR.set_peak_lr``). ``implementation``: a resolved kernel name."""
    flags = _implementation_kwargs(implementation, "cpu")
    for group in optimizer.param_groups:
        group.update(betas=tuple(betas), eps=eps, weight_decay=weight_decay, **flags)
        on_device = flags["fused"] or bool(group.get("capturable"))
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if isinstance(state.get("step"), torch.Tensor):
                # AdamW keeps its step count on the parameter's device for the fused and capturable
                # kernels and on the CPU otherwise; a restored count sits where the saved kernel wanted it
                state["step"] = state["step"].to(device=p.device if on_device else "cpu", dtype=torch.float32)


def build_optimizer(
    model: nn.Module, cfg: OptimizerConfig, device_type: str
) -> torch.optim.Optimizer:
    """Build AdamW over the trainable (``requires_grad``) parameters of ``model``.

    Frozen tables (target embedding / lm_head copies) are skipped so they get no optimizer state
    and never appear in the optimizer's checkpoint.
    """
    if cfg.name.lower() != "adamw":
        raise ValueError(f"unknown optimizer.name {cfg.name!r}; supported: AdamW")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer: the model has no parameter with requires_grad=True")
    flags = _implementation_kwargs(cfg.implementation, device_type)
    optimizer = torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        **flags,
    )
    impl = "fused" if flags["fused"] else "foreach" if flags["foreach"] else "for-loop"
    logger.info(
        "optimizer: AdamW (%s) over %d tensors, %d params, lr=%g betas=(%g, %g) eps=%g wd=%g",
        impl,
        len(params),
        sum(p.numel() for p in params),
        cfg.lr,
        cfg.beta1,
        cfg.beta2,
        cfg.eps,
        cfg.weight_decay,
    )
    return optimizer
