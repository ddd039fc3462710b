"""Process groups, ParallelDims and the FSDP2 / AC / compile transforms, on CPU with gloo.

The 2-rank scenarios run in one ``torch.multiprocessing.spawn`` (module fixture) so the suite pays
the process start-up once; each scenario's numbers come back as JSON and get their own test.
"""

from __future__ import annotations

import copy
import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from multiproc import spawn_ranks
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

WORLD = 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(32, 64)
        self.w2 = nn.Linear(64, 32)

    def forward(self, h):
        return h + self.w2(torch.nn.functional.gelu(self.w1(h)))


class Tiny(nn.Module):
    """embed -> ModuleDict of blocks -> [norm, head], the layout a draft model has."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(2)})
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 16)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks.values():
            h = block(h)
        return self.head(self.norm(h))


def _cpu_config(**float8) -> JobConfig:
    cfg = JobConfig()
    cfg.job.device = "cpu"
    cfg.comm.init_timeout_seconds = 60  # a desynced rank fails the test instead of hanging it
    for k, v in float8.items():
        setattr(cfg.float8, k, v)
    return cfg


# ------------------------------------------------------------------------------------------
# 2-rank scenarios (run inside the spawned workers)


def _run_training(model, ref, rank, *, hook=None, ref_per_rank_chunks=False, steps=2):
    """Sharded training (each rank a half batch, loss over the global denominator) against an
    unsharded reference on the whole batch. Returns the max grad / param differences and losses."""
    from torch.distributed.tensor import DTensor

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    out = {"loss": [], "ref_loss": [], "grad_err": 0.0, "param_err": 0.0}
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
        denom = y.numel()
        loss = ((model(x.chunk(WORLD)[rank]) - y.chunk(WORLD)[rank]) ** 2).sum() / denom
        loss.backward()
        if ref_per_rank_chunks:  # float8 scales activations per forward: mirror the per-rank split
            ref_loss = sum(((ref(xc) - yc) ** 2).sum() for xc, yc in zip(x.chunk(WORLD), y.chunk(WORLD)))
        else:
            ref_loss = ((ref(x) - y) ** 2).sum()
        (ref_loss / denom).backward()
        out["loss"].append(dist_sum(loss.detach()).item())
        out["ref_loss"].append((ref_loss / denom).item())
        for p, rp in zip(model.parameters(), ref.parameters()):
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            out["grad_err"] = max(out["grad_err"], (g - rp.grad).abs().max().item())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if hook is not None:
            hook(model)
        for p, rp in zip(model.parameters(), ref.parameters()):
            out["param_err"] = max(out["param_err"], (p.full_tensor() - rp).abs().max().item())
    return out


def _scenario_fsdp_parity(rank, mesh):
    torch.manual_seed(0)
    ref = Tiny()
    model = copy.deepcopy(ref)
    apply_fsdp(model, mesh, blocks=model.blocks, extra_groups=[[model.norm, model.head]],
               param_dtype="float32", reduce_dtype="float32", gradient_divide_factor=1.0)
    return _run_training(model, ref, rank)


def _scenario_fsdp_mean(rank, mesh):
    """The default reduction is FSDP's mean over ranks: gradients are the reference's / WORLD."""
    torch.manual_seed(0)
    ref = Tiny()
    model = copy.deepcopy(ref)
    apply_fsdp(model, mesh, blocks=model.blocks, param_dtype="float32", reduce_dtype="float32")
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)), torch.zeros(8, 16)
    ((model(x.chunk(WORLD)[rank]) - y.chunk(WORLD)[rank]) ** 2).sum().backward()
    ((ref(x) - y) ** 2).sum().backward()
    err = max((p.grad.full_tensor() * WORLD - rp.grad).abs().max().item()
              for p, rp in zip(model.parameters(), ref.parameters()))
    return {"grad_err": err}


def _scenario_ac_compile_fqns(rank, mesh):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    torch.manual_seed(0)
    ref = Tiny()
    model = copy.deepcopy(ref)
    apply_ac(model.blocks, "full")
    apply_compile(model.blocks, backend="eager")  # dynamo only: the FQN question, not kernels
    apply_fsdp(model, mesh, blocks=model.blocks, extra_groups=[[model.norm, model.head]],
               param_dtype="float32", reduce_dtype="float32", reshard_after_forward="always",
               gradient_divide_factor=1.0)
    out = _run_training(model, ref, rank)
    out["ref_keys"] = sorted(ref.state_dict())
    out["state_dict_keys"] = sorted(model.state_dict())
    out["dcp_keys"] = sorted(get_model_state_dict(model))
    out["wrapped"] = type(model.blocks["0"]).__name__
    return out


def _scenario_float8(rank, mesh):
    from titan_draft.components.float8 import Float8Converter

    torch.manual_seed(0)
    ref = Tiny()
    model = copy.deepcopy(ref)
    fp32_ref = copy.deepcopy(ref)
    cfg = _cpu_config(enable=True)
    conv = Float8Converter(cfg, ParallelDims(-1, WORLD))
    conv.convert(model.blocks, fqn_prefix="blocks")
    Float8Converter(cfg, ParallelDims(1, 1)).convert(ref.blocks, fqn_prefix="blocks")
    apply_fsdp(model, mesh, blocks=model.blocks, extra_groups=[[model.norm, model.head]],
               param_dtype="float32", reduce_dtype="float32", gradient_divide_factor=1.0)
    out = _run_training(model, ref, rank, hook=conv.post_optimizer_hook, ref_per_rank_chunks=True)
    out["describe"] = conv.describe()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
    out["fp32_first_loss"] = (((fp32_ref(x) - y) ** 2).sum() / y.numel()).item()
    return out


def _scenario_frozen(rank, mesh):
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    ref = Tiny().requires_grad_(False)
    model = copy.deepcopy(ref)
    apply_fsdp_frozen(model, mesh, model.blocks, "float32", extra_groups=[[model.norm, model.head]])
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y = model(x)
    return {"err": (y - ref(x)).abs().max().item(),
            "all_sharded_after_forward": all(isinstance(p, DTensor) for p in model.parameters())}


def _scenario_helpers(rank, mesh):
    t = torch.tensor([float(rank + 1), 10.0 * rank])
    s, m = dist_sum(t), dist_max(t)
    return {"sum": s.tolist(), "max": m.tolist(), "input_untouched": t.tolist(),
            "float_sum": dist_sum(float(rank + 1)), "float_max": dist_max(float(rank))}


SCENARIOS = {
    "fsdp_parity": _scenario_fsdp_parity,
    "fsdp_mean": _scenario_fsdp_mean,
    "ac_compile_fqns": _scenario_ac_compile_fqns,
    "float8": _scenario_float8,
    "frozen": _scenario_frozen,
    "helpers": _scenario_helpers,
}


def _worker(rank: int, port: int, out_dir: str) -> None:
    # what torchrun would export: init_distributed must take the env:// path
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    results = {}
    info = init_distributed(_cpu_config())
    results["info"] = {"rank": info.rank, "world_size": info.world_size, "backend": info.backend,
                       "launcher": info.launcher, "device": str(info.device)}
    parallel_dims = ParallelDims.from_config(_cpu_config(), info.world_size)
    mesh = parallel_dims.build_mesh("cpu")
    results["mesh"] = {"names": list(mesh.mesh_dim_names), "size": mesh.size()}
    for name, fn in SCENARIOS.items():
        try:
            results[name] = fn(rank, mesh)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    destroy_distributed()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("two_ranks")
    spawn_ranks(_worker, str(out_dir), nprocs=WORLD)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _scenario(two_ranks, name):
    results = [r[name] for r in two_ranks]
    for r in results:
        assert "error" not in r, r["error"]
    return results


# ------------------------------------------------------------------------------------------
# tests


@pytest.mark.slow
def test_init_distributed_under_torchrun_env(two_ranks):
    for rank, r in enumerate(two_ranks):
        assert r["info"] == {"rank": rank, "world_size": WORLD, "backend": "gloo",
                             "launcher": "torchrun", "device": "cpu"}
        assert r["mesh"] == {"names": ["dp_shard"], "size": WORLD}


@pytest.mark.slow
def test_fsdp_step_matches_unsharded_reference(two_ranks):
    for r in _scenario(two_ranks, "fsdp_parity"):
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["grad_err"] < 1e-5
        assert r["param_err"] < 1e-5


@pytest.mark.slow
def test_fsdp_default_reduction_is_mean(two_ranks):
    for r in _scenario(two_ranks, "fsdp_mean"):
        assert r["grad_err"] < 1e-5


@pytest.mark.slow
def test_ac_compile_fsdp_keep_clean_fqns(two_ranks):
    for r in _scenario(two_ranks, "ac_compile_fqns"):
        assert r["wrapped"].endswith("CheckpointWrapper")  # FSDP2 renames the class FSDP<cls>
        assert r["state_dict_keys"] == r["ref_keys"]
        assert r["dcp_keys"] == r["ref_keys"]
        assert not any("_orig_mod" in k or "_checkpoint_wrapped_module" in k for k in r["dcp_keys"])
        # AC + compile change nothing numerically
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["grad_err"] < 1e-5 and r["param_err"] < 1e-5


@pytest.mark.slow
def test_float8_fsdp_all_gather_matches_unsharded_float8(two_ranks):
    for r in _scenario(two_ranks, "float8"):
        d = r["describe"]
        assert d["converted"] == 4 and d["fsdp_float8_all_gather"] and d["precompute_scales"]
        # same float8 rounding as the unsharded float8 model run per rank-chunk
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["grad_err"] < 1e-4
        # and within float8 tolerance of plain fp32
        assert r["loss"][0] == pytest.approx(r["fp32_first_loss"], rel=0.02)


@pytest.mark.slow
def test_frozen_fsdp_forward_and_reshard(two_ranks):
    for r in _scenario(two_ranks, "frozen"):
        assert r["err"] < 1e-5
        assert r["all_sharded_after_forward"]


@pytest.mark.slow
def test_dist_sum_and_max(two_ranks):
    for rank, r in enumerate(_scenario(two_ranks, "helpers")):
        assert r["sum"] == [3.0, 10.0]
        assert r["max"] == [2.0, 10.0]
        assert r["input_untouched"] == [float(rank + 1), 10.0 * rank]
        assert r["float_sum"] == 3.0 and r["float_max"] == 1.0


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
