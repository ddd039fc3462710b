"""HSDP (parallelism.data_parallel_replicate_degree x data_parallel_shard_degree) on 4 gloo ranks:
the same losses as FSDP over the 4 ranks, an exact resume from an HSDP checkpoint, and FSDP
checkpoints resume under HSDP; plus the layout's validation."""

from __future__ import annotations

import json
import os

import pytest

from titan_draft.config import JobConfig
from titan_draft.distributed.utils import ParallelDims
from helpers import REPO, torchrun


def test_layout_validation():
    assert (ParallelDims(-1, 8, dp_replicate=2).dp_shard, ParallelDims(-1, 8, dp_replicate=2).dp_size) == (4, 8)
    assert ParallelDims(-1, 8, dp_replicate=2).hsdp and not ParallelDims(-1, 8).hsdp
    cfg = JobConfig()
    cfg.parallelism.data_parallel_replicate_degree = 3
    with pytest.raises(ValueError, match="data_parallel_replicate_degree = 3 must be >= 1 and divide the world size 4"):
        ParallelDims.from_config(cfg, world_size=4)
    cfg.parallelism.data_parallel_replicate_degree, cfg.parallelism.data_parallel_shard_degree = 2, 4
    with pytest.raises(ValueError, match="data_parallel_shard_degree = 4 times data_parallel_replicate_degree = 2"):
        ParallelDims.from_config(cfg, world_size=4)


def test_hsdp_equals_fsdp_resumes_and_loads_fsdp_checkpoints(tmp_path, random_target_dir, chat_jsonl):
    base = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_random.toml"),
            "--target.path", random_target_dir, "--data.source", chat_jsonl, "--data.max_length", "64",
            "--training.local_batch_size", "1", "--training.steps", "4", "--checkpoint.interval", "2",
            "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--profiling.enable_profiling", "false", "--checkpoint.export", "false", "--eval.enable", "false"]
    out = tmp_path / "losses.json"
    proc = torchrun(4, os.path.join(REPO, "tests", "workers", "hsdp_worker.py"), str(out), *base, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    runs = {k: {int(s): v for s, v in r.items()} for k, r in json.loads(out.read_text()).items()}
    fsdp, hsdp = runs["fsdp"], runs["hsdp"]
    assert sorted(fsdp) == sorted(hsdp) == [1, 2, 3, 4]
    # same data per rank, same global normalization: only the reduction order differs
    for s in fsdp:
        assert hsdp[s] == pytest.approx(fsdp[s], rel=1e-5), s
    assert fsdp[4] != pytest.approx(fsdp[1], rel=1e-3)  # it trained
    assert sorted(runs["hsdp_resumed"]) == [3, 4]
    for s in (3, 4):
        assert runs["hsdp_resumed"][s] == pytest.approx(hsdp[s], rel=1e-6, abs=1e-7), s
        assert runs["fsdp_to_hsdp"][s] == pytest.approx(fsdp[s], rel=1e-5), s
    info = json.loads((tmp_path / "hsdp" / "run_info.json").read_text())
    assert info["parallelism"] == {"dp_replicate": 2, "dp_shard": 2}
