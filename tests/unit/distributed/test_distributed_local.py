"""The distributed helpers in one process: init without a launcher, ParallelDims and config
checks, activation checkpointing, seeding, and (on a GPU) NCCL + float8 + compile + FSDP2."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from test_distributed import Block, Tiny, _cpu_config
from titan_draft.config import JobConfig
from titan_draft.distributed.parallelize import apply_ac, apply_compile, apply_fsdp, apply_fsdp_frozen
from titan_draft.distributed.utils import (
    ParallelDims,
    destroy_distributed,
    dist_max,
    dist_sum,
    init_distributed,
    set_seed,
)


def test_init_distributed_single_process_without_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    info = init_distributed(_cpu_config())
    try:
        assert (info.rank, info.world_size, info.backend, info.launcher) == (0, 1, "gloo", "single-process")
        assert info.is_main and info.device == torch.device("cpu")
        mesh = ParallelDims(-1, 1).build_mesh("cpu")
        assert mesh.mesh_dim_names == ("dp_shard",) and mesh.size() == 1
        t = torch.tensor([2.0])
        assert dist_sum(t).item() == 2.0 and dist_max(5.0) == 5.0
        # FSDP2 over one rank is the same code path as over many
        torch.manual_seed(0)
        ref = Tiny()
        model = copy.deepcopy(ref)
        apply_fsdp(model, mesh, blocks=model.blocks, param_dtype="float32", reduce_dtype="float32")
        x, y = torch.randn(4, 16), torch.randn(4, 16)
        for m in (model, ref):
            ((m(x) - y) ** 2).mean().backward()
        for p, rp in zip(model.parameters(), ref.parameters()):
            assert torch.allclose(p.grad.full_tensor(), rp.grad, atol=1e-6)
        # a second call reuses the group instead of failing
        assert init_distributed(_cpu_config()).launcher == "existing"
    finally:
        destroy_distributed()
    assert not dist.is_initialized()


def test_helpers_without_process_group():
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    t = torch.tensor([1.0, 2.0])
    out = dist_sum(t)
    assert out.tolist() == [1.0, 2.0] and out is not t
    assert dist_max(3.5) == 3.5


def test_parallel_dims_validation():
    assert ParallelDims(-1, 4).dp_shard == 4
    assert ParallelDims(2, 2).dp_shard_enabled
    assert not ParallelDims(-1, 1).dp_shard_enabled
    cfg = JobConfig()
    cfg.parallelism.data_parallel_shard_degree = 3
    with pytest.raises(ValueError, match="data_parallel_shard_degree = 3"):
        ParallelDims.from_config(cfg, world_size=2)
    with pytest.raises(ValueError, match="data_parallel_shard_degree"):
        ParallelDims(0, 2)
    with pytest.raises(ValueError, match="world size"):
        ParallelDims(-1, 0)
    with pytest.raises(RuntimeError, match="build_mesh"):
        ParallelDims(-1, 1).dp_mesh


def test_bad_choices_rejected():
    with pytest.raises(ValueError, match="activation_checkpoint.mode"):
        apply_ac(nn.ModuleDict({"0": Block()}), "selective")
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward"):
        apply_fsdp(Tiny(), None, blocks=nn.ModuleDict(), reshard_after_forward="sometimes")
    with pytest.raises(ValueError, match="dtype"):
        apply_fsdp(Tiny(), None, blocks=nn.ModuleDict(), param_dtype="int8")
    cfg = JobConfig()
    cfg.job.device = "tpu"
    with pytest.raises(ValueError, match="job.device"):
        init_distributed(cfg)
    if not torch.cuda.is_available():
        cfg.job.device = "cuda"
        with pytest.raises(RuntimeError, match="no CUDA"):
            init_distributed(cfg)


def test_apply_ac_none_is_noop_and_full_wraps():
    blocks = nn.ModuleDict({"0": Block(), "1": Block()})
    before = dict(blocks.items())
    apply_ac(blocks, "none")
    assert dict(blocks.items()) == before
    apply_ac(blocks, "full")
    assert all(type(b).__name__ == "CheckpointWrapper" for b in blocks.values())
    # the wrapper's state_dict hooks keep the plain names
    assert sorted(blocks.state_dict()) == sorted(nn.ModuleDict({"0": Block(), "1": Block()}).state_dict())


def test_set_seed_reproducible():
    set_seed(7)
    a = torch.randn(3)
    set_seed(7)
    assert torch.equal(a, torch.randn(3))


# ------------------------------------------------------------------------------------------
# GPU: the NCCL single-process path with float8 + AC + inductor compile + FSDP2 in bf16


def _gpu_worker(rank: int, out_dir: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from titan_draft.components.float8 import Float8Converter

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        os.environ.pop(var, None)
    cfg = JobConfig()
    cfg.float8.enable = True
    info = init_distributed(cfg)
    dims = ParallelDims.from_config(cfg, info.world_size)
    mesh = dims.build_mesh("cuda")
    torch.manual_seed(0)
    ref = Tiny().cuda()
    model = copy.deepcopy(ref)
    conv = Float8Converter(cfg, dims)
    conv.convert(model.blocks, "blocks")
    apply_ac(model.blocks, "full")
    apply_compile(model.blocks)
    apply_fsdp(model, mesh, blocks=model.blocks, extra_groups=[[model.norm, model.head]],
               gradient_divide_factor=1.0)
    frozen = Tiny().cuda().requires_grad_(False)
    frozen_ref = copy.deepcopy(frozen)
    apply_fsdp_frozen(frozen, mesh, frozen.blocks, "bfloat16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 16, device="cuda"), torch.randn(64, 16, device="cuda")
    losses = []
    for _ in range(3):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        conv.post_optimizer_hook(model)
        losses.append(dist_sum(loss.detach().cpu()).item())  # a CPU tensor through NCCL
    with torch.no_grad():
        ref_loss = ((ref(x) - y) ** 2).mean().item()
        frozen_err = (frozen(x).float() - frozen_ref(x)).abs().max().item()
    result = {"info": [info.backend, info.launcher, info.world_size], "losses": losses,
              "ref_loss": ref_loss, "frozen_err": frozen_err, "describe": conv.describe(),
              "keys_ok": sorted(get_model_state_dict(model)) == sorted(ref.state_dict())}
    with open(os.path.join(out_dir, "gpu.json"), "w") as f:
        json.dump(result, f)
    destroy_distributed()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_single_process_nccl_float8_compile_fsdp(tmp_path):
    mp.spawn(_gpu_worker, args=(str(tmp_path),), nprocs=1, join=True)
    r = json.loads((tmp_path / "gpu.json").read_text())
    assert r["info"] == ["nccl", "single-process", 1]
    d = r["describe"]
    assert d["mode"] == "float8" and d["converted"] == 4 and d["fsdp_float8_all_gather"] is False
    assert r["keys_ok"]
    assert r["losses"][0] == pytest.approx(r["ref_loss"], rel=0.05)  # bf16 params + float8 GEMMs
    assert r["losses"][-1] < r["losses"][0]
    assert r["frozen_err"] < 0.05
