"""GPU paths of the components (skipped without CUDA): fused AdamW, CUDA checkpoints and export,
GPU memory/MFU in the metrics line, CUDA kernels in traces, memory snapshots (also on OOM)."""

import glob
import json
import logging
import os
import pickle

import pytest
import torch
from torch import nn

from titan_draft.checkpoint.manager import CheckpointManager, TrainState
from titan_draft.checkpoint.export import export_draft, load_export
from titan_draft.components.lr_scheduler import build_lr_scheduler
from titan_draft.components.metrics import MetricsLogger
from titan_draft.components.optimizer import build_optimizer
from titan_draft.components.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from titan_draft.config.job_config import Checkpoint, LRScheduler, Metrics, Optimizer, Profiling

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model_opt(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)).cuda()
    opt = build_optimizer(model, Optimizer(lr=1e-2), "cuda")
    return model, opt


def test_fused_adamw_checkpoint_and_export_on_cuda(tmp_path):
    model, opt = _model_opt(0)
    assert opt.param_groups[0]["fused"] is True
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=1), 10)
    state = TrainState()
    mgr = CheckpointManager(Checkpoint(), str(tmp_path), model=model, optimizer=opt,
                            lr_scheduler=sched, dataloader=None, train_state=state, dp_rank=0, dp_world=1)
    for step in range(1, 4):
        model(torch.randn(4, 32, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        state.step = step
    assert mgr.save(3, force=True)
    model2, opt2 = _model_opt(1)
    sched2 = build_lr_scheduler(opt2, LRScheduler(warmup_steps=1), 10)
    state2 = TrainState()
    mgr2 = CheckpointManager(Checkpoint(), str(tmp_path), model=model2, optimizer=opt2,
                             lr_scheduler=sched2, dataloader=None, train_state=state2, dp_rank=0, dp_world=1)
    assert mgr2.load() == 3 and state2.step == 3
    for p, q in zip(model.parameters(), model2.parameters()):
        assert q.is_cuda and torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]

    out = export_draft(model, lambda sd, a, t: (dict(sd), {"n": 1}), None, {}, str(tmp_path / "export"))
    tensors, config = load_export(out)
    assert config == {"n": 1}
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors.values())
    assert torch.equal(tensors["0.weight"], model[0].weight.detach().cpu().bfloat16())


def test_metrics_line_has_gpu_memory_and_mfu(tmp_path, caplog):
    m = MetricsLogger(Metrics(), str(tmp_path), 0, "cuda")
    x = torch.empty(256, 1024, 1024, device="cuda")  # 1 GiB peak
    del x
    with caplog.at_level(logging.INFO, logger="titan_draft.components.metrics"):
        line = m.log(1, {"loss": 2.0, "mfu": 41.5}, total_steps=10)
    assert "mem " in line and " GiB (" in line
    if m.peak_flops is not None:  # known GPU (H100/H200/...)
        assert "mfu 41.50%" in line
    m.close()
    second = MetricsLogger(Metrics(enable_tensorboard=False), str(tmp_path), 0, "cuda")
    assert second.memory_monitor.get_peak_stats()["max_allocated_gib"] < 0.5  # peak was reset


def test_cuda_trace_and_memory_snapshots(tmp_path):
    cfg = Profiling(enable_profiling=True, profile_freq=2, profile_warmup=1, profile_active=1,
                    enable_memory_snapshot=True)
    x = torch.randn(512, 512, device="cuda")
    with maybe_enable_profiling(cfg, str(tmp_path)) as prof, \
            maybe_enable_memory_snapshot(cfg, str(tmp_path)) as snap:
        for _ in range(2):
            x = torch.tanh(x @ x)
            torch.cuda.synchronize()
            prof.step()
            snap.step()
    (trace,) = glob.glob(str(tmp_path / "profile_traces" / "iteration_2" / "rank0_trace.json"))
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    path = tmp_path / "memory_snapshot" / "iteration_2" / "rank0_memory_snapshot.pickle"
    with open(path, "rb") as f:
        assert "segments" in pickle.load(f)

    with pytest.raises(torch.OutOfMemoryError):
        with maybe_enable_memory_snapshot(cfg, str(tmp_path), global_step=5) as snap:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")  # 1 PiB
    assert os.path.isfile(tmp_path / "memory_snapshot" / "iteration_5_exit" / "rank0_memory_snapshot.pickle")
