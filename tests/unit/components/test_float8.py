"""Float8Converter on CPU: which Linears it converts, the uneven-shard guard, numerics.

The 2-rank FSDP2 float8 all-gather run lives in tests/integration/distributed/test_distributed.py.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

from titan_draft.components import float8 as float8_mod  # noqa: E402
from titan_draft.components.float8 import Float8Converter  # noqa: E402
from titan_draft.config import JobConfig  # noqa: E402
from titan_draft.distributed.utils import ParallelDims  # noqa: E402


def _config(**float8) -> JobConfig:
    cfg = JobConfig()
    cfg.job.device = "cpu"
    cfg.float8.enable = True
    for k, v in float8.items():
        setattr(cfg.float8, k, v)
    return cfg


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.ModuleDict({"q": nn.Linear(64, 64), "odd": nn.Linear(64, 40)})
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.frozen = nn.Linear(64, 64).requires_grad_(False)
        self.output = nn.Linear(64, 32)


def test_filter_skips_odd_frozen_and_filtered():
    block = Block()
    conv = Float8Converter(_config(filter_fqns=["output", "blocks.3.mlp.2"]), ParallelDims(1, 1))
    conv.convert(block, fqn_prefix="blocks.3")
    assert isinstance(block.attn["q"], Float8Linear)
    assert isinstance(block.mlp[0], Float8Linear)
    assert type(block.attn["odd"]) is nn.Linear  # 40 rows: not a multiple of 16
    assert type(block.frozen) is nn.Linear
    assert type(block.output) is nn.Linear
    assert type(block.mlp[2]) is nn.Linear  # filter matched the full FQN (prefix included)
    assert sorted(conv.converted) == ["blocks.3.attn.q", "blocks.3.mlp.0"]
    assert conv.skipped["blocks.3.attn.odd"].startswith("shape (40, 64)")
    assert conv.skipped["blocks.3.frozen"] == "frozen"
    assert "output" in conv.skipped["blocks.3.output"]
    assert conv.describe()["converted"] == 2
    # converting again leaves the float8 modules alone
    conv.convert(block, fqn_prefix="blocks.3")
    assert len(conv.converted) == 2


def test_disabled_converter_is_noop():
    cfg = _config()
    cfg.float8.enable = False
    block = Block()
    conv = Float8Converter(cfg, ParallelDims(1, 1))
    assert not conv.enabled
    assert conv.convert(block) is block
    assert not any(isinstance(m, Float8Linear) for m in block.modules())
    assert conv.describe() == {"enabled": False}
    conv.post_optimizer_hook(block)  # nothing to do, no error


def test_meta_device_conversion():
    with torch.device("meta"):
        mlp = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    Float8Converter(_config(), ParallelDims(1, 1)).convert(mlp)
    assert all(isinstance(m, Float8Linear) for m in mlp)
    assert mlp[0].weight.device.type == "meta"


def test_uneven_shard_guard_turns_all_gather_off_once(caplog):
    conv = Float8Converter(_config(), ParallelDims(3, 3))  # 64 rows do not split over 3 ranks
    assert conv.enable_fsdp_float8_all_gather
    with caplog.at_level(logging.WARNING, logger="titan_draft"):
        first, second = nn.Sequential(nn.Linear(64, 64)), nn.Sequential(nn.Linear(64, 96))
        conv.convert(first, "a")
        conv.convert(second, "b")
    off = [r for r in caplog.records if "all-gather OFF" in r.getMessage()]
    assert len(off) == 1 and "DP size 3" in off[0].getMessage() and "a.0" in off[0].getMessage()
    assert not conv.enable_fsdp_float8_all_gather
    assert not first[0].config.enable_fsdp_float8_all_gather
    assert not second[0].config.enable_fsdp_float8_all_gather
    d = conv.describe()
    assert d["fsdp_float8_all_gather"] is False and "does not divide" in d["all_gather_off_reason"]
    assert not conv.precompute_enabled


def test_even_shards_keep_all_gather_and_precompute():
    conv = Float8Converter(_config(), ParallelDims(2, 2))
    mlp = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))
    conv.convert(mlp)
    assert mlp[0].config.enable_fsdp_float8_all_gather
    assert conv.precompute_enabled
    off = Float8Converter(_config(precompute_float8_dynamic_scale_for_fsdp=False), ParallelDims(2, 2))
    off.convert(nn.Sequential(nn.Linear(64, 64)))
    assert not off.precompute_enabled


def test_single_shard_has_no_float8_all_gather():
    conv = Float8Converter(_config(), ParallelDims(1, 1))
    assert not conv.enable_fsdp_float8_all_gather
    assert conv.describe()["all_gather_off_reason"] == "one DP shard"


def test_cpu_uses_real_float8_when_scaled_mm_runs():
    """Records what this machine does: real float8 GEMMs unless torch._scaled_mm fails on CPU."""
    conv = Float8Converter(_config(), ParallelDims(1, 1))
    probe = float8_mod._probe_cpu_scaled_mm()
    assert conv.emulate == (probe is not None)
    assert conv.describe()["mode"] == ("emulated" if probe else "float8")


def test_cpu_falls_back_to_emulation_loudly(monkeypatch, caplog):
    monkeypatch.setattr(float8_mod, "_probe_cpu_scaled_mm", lambda: "RuntimeError: no kernel")
    with caplog.at_level(logging.WARNING, logger="titan_draft"):
        conv = Float8Converter(_config(), ParallelDims(1, 1))
    assert conv.emulate and "no kernel" in conv.emulate_reason
    assert any("EMULATING" in r.getMessage() for r in caplog.records)
    mlp = nn.Sequential(nn.Linear(64, 64))
    conv.convert(mlp)
    assert mlp[0].config.emulate


def test_explicit_emulate_is_reported():
    conv = Float8Converter(_config(emulate=True), ParallelDims(1, 1))
    assert conv.emulate and conv.describe()["emulate_reason"] == "float8.emulate = true"


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("emulate", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_converted_mlp_close_to_reference(emulate, dtype):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).to(dtype)
    mlp = copy.deepcopy(ref)
    Float8Converter(_config(emulate=emulate), ParallelDims(1, 1)).convert(mlp)
    assert all(isinstance(mlp[i], Float8Linear) for i in (0, 2))
    x = torch.randn(48, 64, dtype=dtype)
    x_ref = x.clone().requires_grad_()
    x = x.requires_grad_()
    y, y_ref = mlp(x), ref(x_ref)
    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    # forward operands are e4m3 (3 mantissa bits), gradients e5m2 (2 bits): a few percent of
    # relative error, and never zero (which would mean nothing ran in float8)
    assert 1e-3 < _rel_err(y, y_ref) < 0.08
    assert 1e-3 < _rel_err(x.grad, x_ref.grad) < 0.15
    for i in (0, 2):
        assert 1e-3 < _rel_err(mlp[i].weight.grad, ref[i].weight.grad) < 0.15
    # the last bias sees the unquantized output gradient
    assert _rel_err(mlp[2].bias.grad, ref[2].bias.grad) < 1e-2


def test_real_float8_matches_emulation_on_cpu():
    if float8_mod._probe_cpu_scaled_mm() is not None:
        pytest.skip("no real float8 matmul on this CPU")
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    real, emulated = copy.deepcopy(ref), copy.deepcopy(ref)
    Float8Converter(_config(), ParallelDims(1, 1)).convert(real)
    Float8Converter(_config(emulate=True), ParallelDims(1, 1)).convert(emulated)
    x = torch.randn(48, 64)
    for m in (real, emulated):
        m(x).square().sum().backward()
    assert _rel_err(real(x), emulated(x)) < 1e-3
    assert _rel_err(real[0].weight.grad, emulated[0].weight.grad) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_float8_mlp_eager_and_compiled(compiled):
    cfg = _config()
    cfg.job.device = "cuda"
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).cuda().to(torch.bfloat16)
    mlp = copy.deepcopy(ref)
    conv = Float8Converter(cfg, ParallelDims(1, 1))
    conv.convert(mlp)
    assert conv.describe()["mode"] == "float8"  # sm_89+: real float8 GEMMs
    if compiled:
        mlp.compile()
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    y, y_ref = mlp(x), ref(x)
    y.float().square().mean().backward()
    y_ref.float().square().mean().backward()
    assert 1e-3 < _rel_err(y, y_ref) < 0.08
    assert _rel_err(mlp[0].weight.grad, ref[0].weight.grad) < 0.15
