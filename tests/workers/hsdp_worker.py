"""Run under torchrun (4 gloo ranks) by tests/integration/distributed/test_hsdp.py: several trainers in one process
group, each a job of its own; rank 0 writes every run's losses to argv[1] as JSON."""

from __future__ import annotations

import json
import os
import shutil
import sys

import torch.distributed as dist

from helpers import run_training  # tests/ is on PYTHONPATH (helpers.torchrun)
from titan_draft.distributed.utils import destroy_distributed


def train(argv: list[str], crash_after_step: int | None = None) -> dict[int, float]:
    try:
        return run_training(argv, crash_after_step, keep_process_group=True)
    except KeyboardInterrupt:
        return {}


def main() -> None:
    out, base = sys.argv[1], sys.argv[2:]
    root = os.path.dirname(out)

    def job(name: str, *extra: str) -> list[str]:
        return [*base, "--job.dump_folder", os.path.join(root, name), *extra]

    hsdp = ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2")
    runs = {"fsdp": train(job("fsdp")), "hsdp": train(job("hsdp", *hsdp))}
    train(job("hsdp_killed", *hsdp), crash_after_step=2)
    runs["hsdp_resumed"] = train(job("hsdp_killed", *hsdp))
    # an FSDP checkpoint resumed under HSDP (DCP reshards to the 2-D mesh)
    if dist.get_rank() == 0:
        shutil.copytree(os.path.join(root, "fsdp"), os.path.join(root, "fsdp_to_hsdp"))
    dist.barrier()
    runs["fsdp_to_hsdp"] = train(job("fsdp_to_hsdp", *hsdp, "--checkpoint.load_step", "2"))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({k: {str(s): v for s, v in r.items()} for k, r in runs.items()}, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
