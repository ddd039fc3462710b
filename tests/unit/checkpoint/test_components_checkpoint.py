"""CheckpointManager: round trip, newest-complete choice, retention, refusals, FSDP2 on gloo."""

import logging
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import spawn_ranks
from titan_draft.checkpoint.manager import CheckpointManager, TrainState
from titan_draft.checkpoint.resume_guard import ResumeRefusedError
from titan_draft.components.lr_scheduler import build_lr_scheduler
from titan_draft.components.optimizer import build_optimizer
from titan_draft.config.job_config import Checkpoint, LRScheduler, Optimizer


class FakeLoader:
    """Stand-in for the stateful dataloader: a position and a nested, partly empty state."""

    def __init__(self, pos: int = 0) -> None:
        self.pos = pos

    def state_dict(self):
        return {"pos": self.pos, "epoch": {"n": self.pos // 3}, "empty": {}}

    def load_state_dict(self, state):
        assert state["empty"] == {} and state["epoch"]["n"] == state["pos"] // 3
        self.pos = state["pos"]


class Draft(nn.Module):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(hidden, hidden) for i in range(2)})
        self.head = nn.Linear(hidden, 3)
        self.register_buffer("rope_cache", torch.arange(4.0), persistent=False)

    def forward(self, x):
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.head(x)


def _parts(seed: int = 0, hidden: int = 8, dp_rank: int = 0):
    torch.manual_seed(seed)
    model = Draft(hidden)
    opt = build_optimizer(model, Optimizer(lr=1e-2, weight_decay=0.01), "cpu")
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=2), 20)
    return model, opt, sched, FakeLoader(), TrainState()


def _manager(folder, parts, cfg=None, dp_rank=0, dp_world=1):
    model, opt, sched, loader, state = parts
    return CheckpointManager(
        cfg or Checkpoint(interval=2), str(folder), model=model, optimizer=opt,
        lr_scheduler=sched, dataloader=loader, train_state=state, dp_rank=dp_rank, dp_world=dp_world,
    )


def _train(parts, steps, start=1, seed=100):
    model, opt, sched, loader, state = parts
    for step in range(start, start + steps):
        gen = torch.Generator().manual_seed(seed + step)
        x = torch.randn(4, model.head.in_features, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        loader.pos += 1
        state.step = step
        state.tokens_seen += 16


def _assert_same(a, b):
    ma, oa, sa, la, ta = a
    mb, ob, sb, lb, tb = b
    sda, sdb = ma.state_dict(), mb.state_dict()
    assert sda.keys() == sdb.keys()
    for k in sda:
        assert torch.equal(sda[k], sdb[k]), k
    for pa, pb in zip(ma.parameters(), mb.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(oa.state[pa][key], ob.state[pb][key]), key
    assert oa.param_groups[0]["lr"] == ob.param_groups[0]["lr"]
    assert sa.state_dict()["last_epoch"] == sb.state_dict()["last_epoch"]
    assert (la.pos, ta.step, ta.tokens_seen) == (lb.pos, tb.step, tb.tokens_seen)


def test_round_trip_restores_everything(tmp_path):
    ref = _parts()
    mgr = _manager(tmp_path, ref)
    _train(ref, 5)
    assert not mgr.save(5)  # not on the interval
    assert mgr.save(5, force=True)
    assert not mgr.save(5, force=True)  # already saved this step
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-5"]

    resumed = _parts(seed=1)  # different init: everything must come from the checkpoint
    assert _manager(tmp_path, resumed).load() == 5
    _assert_same(ref, resumed)
    # Training on from both gives identical results (moments, step counts and lr all restored).
    _train(ref, 3, start=6)
    _train(resumed, 3, start=6)
    _assert_same(ref, resumed)


def test_newest_complete_is_loaded_and_incomplete_skipped(tmp_path, caplog):
    ref = _parts()
    mgr = _manager(tmp_path, ref, Checkpoint(interval=2, keep_latest_k=0))
    for step in range(1, 5):
        _train(ref, 1, start=step)
        mgr.save(step)
    # An interrupted save: data files but no .metadata.
    root = tmp_path / "checkpoint"
    shutil.copytree(root / "step-4", root / "step-6")
    os.remove(root / "step-6" / ".metadata")

    resumed = _parts(seed=1)
    with caplog.at_level(logging.WARNING):
        assert _manager(tmp_path, resumed).load() == 4
    assert "step-6" in caplog.text and "incomplete" in caplog.text
    _assert_same(ref, resumed)
    assert (root / "step-6").is_dir()  # nothing is deleted

    explicit = _parts(seed=1)
    assert _manager(tmp_path, explicit, Checkpoint(load_step=2)).load() == 2
    assert explicit[4].step == 2
    # a requested step that is not a complete checkpoint: one line naming the folder and the steps there
    with pytest.raises(ResumeRefusedError, match=r"^checkpoint step 6 requested \(checkpoint.load_step\) but "
                       r".*step-6 has no .metadata \(an interrupted save\); the complete checkpoints in "
                       r".*checkpoint are step-2, step-4 \(checkpoint.load_step -1 resumes from the newest\)$"):
        _manager(tmp_path, _parts(), Checkpoint(load_step=6)).load()
    with pytest.raises(ResumeRefusedError, match=r"step-7 does not exist; the complete checkpoints in .* are "
                                                 r"step-2, step-4 "):
        _manager(tmp_path, _parts(), Checkpoint(load_step=7)).load()


def test_nothing_to_load_returns_zero(tmp_path):
    assert _manager(tmp_path, _parts()).load() == 0
    assert _manager(tmp_path, _parts(), Checkpoint(enable=False)).load() == 0


def test_keep_latest_k_removes_oldest_complete(tmp_path):
    parts = _parts()
    mgr = _manager(tmp_path, parts, Checkpoint(interval=1, keep_latest_k=2))
    root = tmp_path / "checkpoint"
    os.makedirs(root / "step-0")  # incomplete leftovers are not counted nor removed
    for step in range(1, 5):
        _train(parts, 1, start=step)
        assert mgr.save(step)
    assert sorted(os.listdir(root)) == ["step-0", "step-3", "step-4"]
    # Resuming from an older step must not delete the checkpoint just written.
    mgr2 = _manager(tmp_path, _parts(), Checkpoint(interval=1, keep_latest_k=1, load_step=3))
    assert mgr2.load() == 3
    assert mgr2.save(2, force=True)
    assert (root / "step-2" / ".metadata").is_file()


def test_another_dp_size_needs_every_saved_ranks_entry(tmp_path):
    parts = _parts()
    _train(parts, 1)
    _manager(tmp_path, parts, dp_rank=0, dp_world=2).save(2)  # rank 1's entry was never written
    with pytest.raises(RuntimeError, match=r"step-2: cannot read the dataloader state \(.*dataloader.dp_rank_1"):
        _manager(tmp_path, _parts(), dp_world=1).load()


def test_shape_mismatch_names_the_folder_and_keeps_files(tmp_path):
    parts = _parts(hidden=8)
    _train(parts, 1)
    _manager(tmp_path, parts).save(2)
    before = sorted(os.listdir(tmp_path / "checkpoint" / "step-2"))
    with pytest.raises(RuntimeError, match="step-2") as err:
        _manager(tmp_path, _parts(hidden=6)).load()
    assert "mismatch" in str(err.value)
    assert sorted(os.listdir(tmp_path / "checkpoint" / "step-2")) == before


def test_compiled_model_has_clean_keys(tmp_path):
    # get_model_state_dict strips torch.compile's _orig_mod. prefix.
    model, opt, sched, loader, state = _parts()
    compiled = torch.compile(model, backend="eager")
    mgr = CheckpointManager(
        Checkpoint(), str(tmp_path), model=compiled, optimizer=opt, lr_scheduler=None,
        dataloader=None, train_state=None, dp_rank=0, dp_world=1,
    )
    assert mgr.save(1, force=True)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(tmp_path / "checkpoint" / "step-1")).read_metadata().state_dict_metadata
    assert "model.layers.0.weight" in keys
    assert not any("_orig_mod" in k or "rope_cache" in k for k in keys)


# ---- two ranks, FSDP2-sharded model and optimizer, gloo ----------------------------------------


def _fsdp_parts(seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # An explicit CPU mesh: without one, fully_shard picks CUDA whenever a GPU is visible.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(seed)
    model = Draft(hidden=8)
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = build_optimizer(model, Optimizer(lr=1e-2), "cpu")
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=2), 20)
    return model, opt, sched, FakeLoader(), TrainState()


def _full(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return msd, osd


def _gloo_worker(rank, port, world, folder):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        ref = _fsdp_parts(seed=0)
        _train(ref, 3, seed=100 + 10 * rank)  # different data per rank
        ref[3].pos += 100 * rank  # per-rank dataloader positions differ
        mgr = _manager(folder, ref, dp_rank=rank, dp_world=world)
        assert mgr.save(3, force=True)

        resumed = _fsdp_parts(seed=1)
        assert _manager(folder, resumed, dp_rank=rank, dp_world=world).load() == 3
        assert resumed[3].pos == ref[3].pos and resumed[4].step == 3
        ref_full = _full(ref[0], ref[1])
        for a, b in zip(ref_full, _full(resumed[0], resumed[1])):
            flat_a, flat_b = torch.utils._pytree.tree_flatten(a)[0], torch.utils._pytree.tree_flatten(b)[0]
            assert len(flat_a) == len(flat_b)
            for x, y in zip(flat_a, flat_b):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        if rank == 0:
            torch.save(ref_full[0], os.path.join(folder, "full_model.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_two_ranks_gloo(tmp_path):
    spawn_ranks(_gloo_worker, 2, str(tmp_path))
    # The sharded checkpoint reshards into one unsharded process, but only without the per-rank
    # dataloader state: FakeLoader keeps no per-rank keys, so the two positions cannot be merged.
    with pytest.raises(ValueError, match=r"states of the 2 saved DP ranks share the keys \['empty', 'epoch', 'pos'\]"):
        _manager(tmp_path, _parts(seed=1)).load()
    model, opt, *_ = _parts(seed=1)
    mgr = CheckpointManager(
        Checkpoint(), str(tmp_path), model=model, optimizer=opt, lr_scheduler=None,
        dataloader=None, train_state=None, dp_rank=0, dp_world=1,
    )
    assert mgr.load() == 3
    full = torch.load(tmp_path / "full_model.pt")
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[k]), k
