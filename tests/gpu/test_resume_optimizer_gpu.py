"""checkpoint.apply_new_optimizer_settings on CUDA (skipped without it): a checkpoint of the fused
AdamW kernel resumed with another kernel, and back, trains on with this job's settings (checked
against AdamW written out in float64)."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from titan_draft.checkpoint.manager import CheckpointManager, TrainState
from titan_draft.checkpoint.resume_guard import ResumeRefusedError, build_optimizer_keys
from titan_draft.components.lr_scheduler import build_lr_scheduler
from titan_draft.components.optimizer import build_optimizer
from titan_draft.config.job_config import Checkpoint, LRScheduler, Optimizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class _Job:
    def __init__(self, implementation: str, lr: float, weight_decay: float, seed: int):
        self.o = Optimizer(lr=lr, weight_decay=weight_decay, implementation=implementation)
        self.s = LRScheduler(warmup_steps=1, decay_type="constant")
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).cuda()
        self.opt = build_optimizer(self.model, self.o, "cuda")
        self.sched = build_lr_scheduler(self.opt, self.s, 10)
        self.keys = build_optimizer_keys(SimpleNamespace(optimizer=self.o, lr_scheduler=self.s), "cuda", 10)

    def manager(self, root, **ckpt) -> CheckpointManager:
        return CheckpointManager(Checkpoint(interval=1, **ckpt), str(root), model=self.model, optimizer=self.opt,
                                 lr_scheduler=self.sched, dataloader=None, train_state=TrainState(), dp_rank=0,
                                 dp_world=1, optimizer_keys=self.keys)

    def grads(self, step: int) -> None:
        self.opt.zero_grad()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)).cuda()
        self.model(x).pow(2).mean().backward()


@pytest.mark.parametrize("saved_kernel,new_kernel", [("fused", "foreach"), ("for-loop", "fused")])
def test_another_kernel_and_lr_resume_on_cuda(tmp_path, saved_kernel, new_kernel):
    saved = _Job(saved_kernel, lr=1e-2, weight_decay=0.0, seed=0)
    for step in (1, 2):
        saved.grads(step)
        saved.opt.step()
        saved.sched.step()
    assert saved.manager(tmp_path).save(2)

    with pytest.raises(ResumeRefusedError, match=f"optimizer.implementation \"{saved_kernel}\" -> \"{new_kernel}\""):
        _Job(new_kernel, lr=1e-3, weight_decay=0.1, seed=1).manager(tmp_path).load()
    new = _Job(new_kernel, lr=1e-3, weight_decay=0.1, seed=1)
    assert new.manager(tmp_path, apply_new_optimizer_settings=True).load() == 2
    group = new.opt.param_groups[0]
    assert (group["fused"], group["foreach"]) == (new_kernel == "fused", new_kernel == "foreach")
    assert group["lr"] == 1e-3 and group["weight_decay"] == 0.1
    for step in (3, 4):
        new.grads(step)
        params = list(new.model.parameters())
        expected = []
        for p in params:
            st = new.opt.state[p]
            t = float(st["step"]) + 1
            m = 0.9 * st["exp_avg"].double() + 0.1 * p.grad.double()
            v = 0.95 * st["exp_avg_sq"].double() + 0.05 * p.grad.double() ** 2
            w = p.detach().double() * (1 - 1e-3 * 0.1)
            expected.append(w - 1e-3 * (m / (1 - 0.9**t)) / ((v / (1 - 0.95**t)).sqrt() + 1e-8))
        new.opt.step()
        new.sched.step()
        for p, want in zip(params, expected):
            torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)
