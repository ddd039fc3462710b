"""build_optimizer: AdamW hyper-parameters, implementation choice, frozen params, bad names."""

import pytest
import torch
from torch import nn

from titan_draft.components.optimizer import _implementation_kwargs, build_optimizer
from titan_draft.config.job_config import Optimizer


def _model() -> nn.Module:
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m[0].weight.requires_grad_(False)  # a frozen table
    return m


def test_adamw_hyperparameters_and_trainable_params_only():
    m = _model()
    cfg = Optimizer(lr=1e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1)
    opt = build_optimizer(m, cfg, "cpu")
    assert isinstance(opt, torch.optim.AdamW)
    (group,) = opt.param_groups
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (1e-3, (0.8, 0.9), 1e-6, 0.1)
    ids = {id(p) for p in group["params"]}
    assert ids == {id(p) for p in m.parameters() if p.requires_grad}
    assert id(m[0].weight) not in ids
    assert group["foreach"] is True and group["fused"] is False  # auto on CPU
    m(torch.randn(3, 4)).sum().backward()
    opt.step()  # runs


def test_implementation_choice():
    assert _implementation_kwargs("auto", "cuda") == {"fused": True, "foreach": False}
    assert _implementation_kwargs("auto", "cpu") == {"fused": False, "foreach": True}
    assert _implementation_kwargs("for-loop", "cuda") == {"fused": False, "foreach": False}
    opt = build_optimizer(_model(), Optimizer(implementation="for-loop"), "cpu")
    assert not opt.param_groups[0]["foreach"] and not opt.param_groups[0]["fused"]


def test_bad_names():
    with pytest.raises(ValueError, match="optimizer.name"):
        build_optimizer(_model(), Optimizer(name="Lion"), "cpu")
    with pytest.raises(ValueError, match="optimizer.implementation"):
        build_optimizer(_model(), Optimizer(implementation="turbo"), "cpu")
