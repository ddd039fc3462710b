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
from torch import nn

from helpers import spawn_ranks
from titan_draft.config import JobConfig
from titan_draft.distributed.parallelize import apply_ac, apply_compile, apply_fsdp, apply_fsdp_frozen
from titan_draft.distributed.utils import (
    ParallelDims,
    destroy_distributed,
    dist_max,
    dist_sum,
    init_distributed,
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


class Unrolled(Tiny):
    """Tiny whose one block forward calls three times, as EAGLE-3's training-time test does."""

    def __init__(self):
        super().__init__()
        del self.blocks["1"]

    def forward(self, x):
        h = self.embed(x)
        for _ in range(3):
            h = self.blocks["0"](h)
        return self.head(self.norm(h))


def _scenario_reused_block(rank, mesh):
    """apply_fsdp(shard_blocks=False) leaves a block that forward calls 3 times to the root unit,
    gathered once a step with the root's own parameters (not 3 + 3 gathers of its own), and
    trains as the unsharded reference does."""
    from torch.distributed.tensor import DTensor

    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(torch.distributed, n)]
    calls = {"n": 0}
    saved = {n: getattr(torch.distributed, n) for n in names}

    def counting(fn):
        def wrapped(*args, **kwargs):
            calls["n"] += 1
            return fn(*args, **kwargs)
        return wrapped

    out = {}
    for reused in (False, True):  # reused: shard_blocks=False
        torch.manual_seed(0)
        ref = Unrolled()
        model = copy.deepcopy(ref)
        apply_fsdp(model, mesh, blocks=model.blocks, extra_groups=[[model.norm, model.head]],
                   param_dtype="float32", reduce_dtype="float32", gradient_divide_factor=1.0,
                   shard_blocks=not reused)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
        for n in names:
            setattr(torch.distributed, n, counting(saved[n]))
        try:
            calls["n"] = 0
            loss = model(x).square().sum()
            block_sharded = any(isinstance(p, DTensor) for p in model.blocks["0"].parameters())
            loss.backward()
            gathers = calls["n"]
        finally:
            for n in names:
                setattr(torch.distributed, n, saved[n])
        model.zero_grad(set_to_none=True)
        res = _run_training(model, ref, rank, steps=2) if reused else {}
        out[str(reused)] = {"gathers": gathers, "block_sharded_after_forward": block_sharded, **res}
    return out


def _scenario_compiled_frozen_capture(rank, mesh):
    """A target sharded by apply_fsdp_frozen captures through its compiled layer (dynamo leaves
    FSDP2's unshard hooks to run eagerly) what the unsharded eager target captures."""
    from dataclasses import replace

    from models.targets.qwen3 import Qwen3Model, qwen3_flavors

    args = replace(qwen3_flavors["debugmodel"], vocab_size=97, hidden_size=32, intermediate_size=48, head_dim=8)
    ref = Qwen3Model(args)
    ref.init_weights(seed=3)
    ref.requires_grad_(False)
    model = copy.deepcopy(ref)
    apply_fsdp_frozen(model, mesh, model.layers, "float32")  # as load_target shards a target
    model.compile_capture("inductor")
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        aux, last = model.capture(ids, [0, 3], need_last_hidden=True)
        want_aux, want_last = ref.capture(ids, [0, 3], need_last_hidden=True)
    return {"aux_err": (aux - want_aux).abs().max().item(), "last_err": (last - want_last).abs().max().item()}


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
    "reused_block": _scenario_reused_block,
    "compiled_frozen_capture": _scenario_compiled_frozen_capture,
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
def test_block_called_several_times_is_gathered_once(two_ranks):
    for r in _scenario(two_ranks, "reused_block"):
        default, reused = r["False"], r["True"]
        assert default["block_sharded_after_forward"] and not reused["block_sharded_after_forward"]
        # the block's own 3 forward + 3 backward gathers are gone: the root's one gather (which
        # the head group's one keeps company either way) now carries its parameters
        assert default["gathers"] - reused["gathers"] == 6, (default["gathers"], reused["gathers"])
        assert reused["loss"] == pytest.approx(reused["ref_loss"], rel=1e-5)
        assert reused["grad_err"] < 1e-5 and reused["param_err"] < 1e-5


@pytest.mark.slow
def test_sharded_target_captures_through_its_compiled_layer(two_ranks):
    for r in _scenario(two_ranks, "compiled_frozen_capture"):
        assert r["aux_err"] < 1e-5 and r["last_err"] < 1e-5, r


@pytest.mark.slow
def test_dist_sum_and_max(two_ranks):
    for rank, r in enumerate(_scenario(two_ranks, "helpers")):
        assert r["sum"] == [3.0, 10.0]
        assert r["max"] == [2.0, 10.0]
        assert r["input_untouched"] == [float(rank + 1), 10.0 * rank]
        assert r["float_sum"] == 3.0 and r["float_max"] == 1.0
