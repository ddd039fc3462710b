"""A checkpoint of 2 gloo ranks resumed on 4: DCP reshards the FSDP2 model and optimizer to exactly
the saved values, the data position continues the global samples of the uninterrupted 2-rank run,
and a position that cannot move (shuffled, mid-epoch) is refused with the same line on every rank."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from helpers import spawn_ranks, write_rank_result
from titan_draft.checkpoint.manager import CheckpointManager, TrainState
from titan_draft.components.lr_scheduler import build_lr_scheduler
from titan_draft.components.optimizer import build_optimizer
from titan_draft.checkpoint.resume_guard import build_data_keys
from titan_draft.config import JobConfig
from titan_draft.config.job_config import Checkpoint, LRScheduler, Optimizer
from titan_draft.data.chat.format import ChatFormat
from titan_draft.data.pipeline import build_dataloader
from titan_draft.data.tokenizer import build_tokenizer

ROWS, SAVED_STEPS, NEXT_STEPS, GLOBAL_BATCH = 16, 3, 6, 4  # the next steps cross into epoch 1


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Linear(8, 8) for i in range(2)})
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for layer in self.layers.values():
            x = torch.tanh(layer(x))
        return self.head(x)


def _write_rows(path: str, n: int = ROWS) -> None:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"q {i}"},
                                                  {"from": "gpt", "value": f"answer {i}"}]}) + "\n")


def _job(source: str, world: int, shuffle: bool) -> JobConfig:
    cfg = JobConfig()
    cfg.data.source, cfg.data.max_length, cfg.data.chat_template, cfg.data.shuffle = source, 64, "chatml", shuffle
    cfg.training.local_batch_size = GLOBAL_BATCH // world
    return cfg


def _parts(cfg: JobConfig, tok, seed: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = Tiny()
    for layer in model.layers.values():
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = build_optimizer(model, Optimizer(lr=1e-2), "cpu")
    sched = build_lr_scheduler(opt, LRScheduler(warmup_steps=2), 20)
    dl = build_dataloader(cfg.data, tok, dp_rank=rank, dp_world=world, local_batch_size=cfg.training.local_batch_size,
                          seed=cfg.training.seed, static_shapes=False)
    return model, opt, sched, dl, TrainState()


def _manager(folder: str, cfg: JobConfig, parts) -> CheckpointManager:
    model, opt, sched, dl, state = parts
    chat = ChatFormat("chatml", "", cfg.data.enable_thinking, cfg.data.last_turn_only)
    keys = build_data_keys(cfg, chat=chat, dp_world=dist.get_world_size())
    return CheckpointManager(Checkpoint(interval=1), folder, model=model, optimizer=opt, lr_scheduler=sched,
                             dataloader=dl, train_state=state, dp_rank=dist.get_rank(),
                             dp_world=dist.get_world_size(), data_keys=keys)


def _rows(batch, tok) -> list[int]:
    return [int(re.search(r"answer (\d+)", tok.decode(ids[:n].tolist())).group(1))
            for ids, n in zip(batch["input_ids"], batch["valid_lengths"])]


def _global_steps(dl, tok, steps: int) -> list[list[int]]:
    """Each step's rows in global order (rank r's j-th sample of the step is global sample r + j * world)."""
    world, out = dist.get_world_size(), []
    for _ in range(steps):
        parts: list = [None] * world
        dist.all_gather_object(parts, _rows(next(dl), tok))
        out.append([parts[g % world][g // world] for g in range(GLOBAL_BATCH)])
    return out


def _train(parts, tok, steps: int) -> None:
    model, opt, sched, dl, state = parts
    for _ in range(steps):
        rows = torch.tensor(_rows(next(dl), tok), dtype=torch.float32)
        x = torch.stack([torch.sin(rows[:, None] * (k + 1)) for k in range(8)], dim=-1)[:, 0]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        state.step += 1


def _full(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd}


def _save_two(rank, port, root):
    torch.set_num_threads(1)  # several ranks share two cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        tok, source = build_tokenizer("qwen3"), os.path.join(root, "rows.jsonl")
        cfg = _job(source, 2, shuffle=False)
        parts = _parts(cfg, tok, seed=0)
        _train(parts, tok, SAVED_STEPS)
        assert _manager(os.path.join(root, "plain"), cfg, parts).save(SAVED_STEPS)
        full = _full(parts[0], parts[1])
        reference = _global_steps(parts[3], tok, NEXT_STEPS)  # what the uninterrupted run reads next
        shuffled = _job(source, 2, shuffle=True)
        sparts = _parts(shuffled, tok, seed=0)
        _train(sparts, tok, 1)
        assert _manager(os.path.join(root, "shuffled"), shuffled, sparts).save(1)
        if rank == 0:
            torch.save(full, os.path.join(root, "full.pt"))
            with open(os.path.join(root, "reference.json"), "w") as f:
                json.dump(reference, f)
    finally:
        dist.destroy_process_group()


def _resume_four(rank, port, root):
    torch.set_num_threads(1)  # several ranks share two cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    tok, source = build_tokenizer("qwen3"), os.path.join(root, "rows.jsonl")

    def compute():
        cfg = _job(source, 4, shuffle=False)
        parts = _parts(cfg, tok, seed=1)  # another init: everything must come from the checkpoint
        loaded = _manager(os.path.join(root, "plain"), cfg, parts).load()
        saved, now = torch.load(os.path.join(root, "full.pt")), _full(parts[0], parts[1])
        saved_flat, now_flat = (torch.utils._pytree.tree_flatten_with_path(d)[0] for d in (saved, now))
        unequal = [str(p) for (p, a), (_, b) in zip(saved_flat, now_flat)
                   if not (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b)]
        result = {"loaded": loaded, "n_state": [len(saved_flat), len(now_flat)], "unequal": unequal,
                  "sched_epoch": parts[2].last_epoch, "next": _global_steps(parts[3], tok, NEXT_STEPS)}
        shuffled = _job(source, 4, shuffle=True)
        try:
            _manager(os.path.join(root, "shuffled"), shuffled, _parts(shuffled, tok, seed=1)).load()
            result["refusal"] = None
        except ValueError as e:
            result["refusal"] = str(e)
        return result

    try:
        write_rank_result(root, rank, compute)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_resume_on_four(tmp_path):
    root = str(tmp_path)
    _write_rows(os.path.join(root, "rows.jsonl"))
    spawn_ranks(_save_two, root, nprocs=2)
    spawn_ranks(_resume_four, root, nprocs=4)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    reference = json.loads((tmp_path / "reference.json").read_text())
    for res in results:
        assert "error" not in res, res.get("error")
        assert res["loaded"] == SAVED_STEPS and res["sched_epoch"] == SAVED_STEPS
        assert res["n_state"][0] == res["n_state"][1] > 10 and res["unequal"] == []
        assert res["next"] == reference  # the same global samples in the same global order
    assert sorted(sum(reference[:1], [])) == list(range(12, 16))  # epoch 0's last rows, then epoch 1
    # one line, the same on every rank (the ranks that could continue refuse with the others)
    assert len({res["refusal"] for res in results}) == 1
    assert re.match(r"data: the data position saved by 2 DP ranks cannot be moved exactly to 4: with data.shuffle "
                    r".*; resume with 2 DP ranks, or set checkpoint.reset_data_position = true", results[0]["refusal"])


# ---- the same through the real trainer (torchrun, 2 ranks, then 4 from the 2-rank step-2) ---------


def _read_counts_at(step_dir: str) -> list[int]:
    """How many times each row had been read by the run that saved ``step_dir`` (every rank's position)."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    from titan_draft.data.loader_state import find_source_state
    from titan_draft.data.reshard import read_counts
    from titan_draft.data.sources.chat import STATE_KEY

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe: dict = {"dataloader": {"dp_world": None}}
        dcp.load(probe, checkpoint_id=step_dir)
        world = int(probe["dataloader"]["dp_world"])
        probe = {"dataloader": {f"dp_rank_{r}": None for r in range(world)}}
        dcp.load(probe, checkpoint_id=step_dir)
    states = []
    for r in range(world):
        loader_state = pickle.loads(pickle.loads(probe["dataloader"][f"dp_rank_{r}"])[f"dp_rank_{r}"])
        states.append(find_source_state(loader_state, STATE_KEY))
    return read_counts(states, lambda n, epoch: list(range(n))).tolist()


def _torchrun(nprocs: int, argv: list[str]) -> str:
    from helpers import torchrun

    proc = torchrun(nprocs, "-m", "titan_draft.train", *argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_trainer_resumes_a_two_rank_run_on_four(tmp_path, random_target_dir):
    import shutil

    from helpers import job_args

    _write_rows(str(tmp_path / "rows.jsonl"), 40)
    common = ("--data.shuffle", "false", "--training.steps", "4", "--checkpoint.interval", "2",
              "--checkpoint.keep_latest_k", "0", "--checkpoint.export", "false", "--eval.enable", "false")
    _torchrun(2, job_args(tmp_path / "two", str(tmp_path / "rows.jsonl"), random_target_dir, *common))
    shutil.copytree(tmp_path / "two", tmp_path / "four", ignore=shutil.ignore_patterns("step-4"))
    log = _torchrun(4, job_args(tmp_path / "four", str(tmp_path / "rows.jsonl"), random_target_dir, *common,
                                "--training.local_batch_size", "1"))  # 2 x 2 = 4 x 1 samples a step
    assert "resumed from step 2" in log
    uninterrupted = _read_counts_at(str(tmp_path / "two" / "checkpoint" / "step-4"))
    resumed = _read_counts_at(str(tmp_path / "four" / "checkpoint" / "step-4"))
    assert resumed == uninterrupted == [1] * 16 + [0] * 24  # 4 steps of 4: rows 0-15, each once
