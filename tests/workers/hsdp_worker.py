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


def train(argv: list[str]) -> dict[int, float]:
    return run_training(argv, keep_process_group=True)


def main() -> None:
    out, base = sys.argv[1], sys.argv[2:]
    root = os.path.dirname(out)

    def job(name: str, *extra: str) -> list[str]:
        return [*base, "--job.dump_folder", os.path.join(root, name), *extra]

    hsdp = ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2")
    runs = {"fsdp": train(job("fsdp")), "hsdp": train(job("hsdp", *hsdp))}
    # each run's step-2 checkpoint resumed under HSDP in a copy of its folder: HSDP's own (its
    # 2-D sharded state and data position), and FSDP's (DCP reshards it to the 2-D mesh). A
    # resume from a killed run's last checkpoint is the same load (tests/integration/reliability)
    if dist.get_rank() == 0:
        for run, copy in (("hsdp", "hsdp_resumed"), ("fsdp", "fsdp_to_hsdp")):
            shutil.copytree(os.path.join(root, run), os.path.join(root, copy))
    dist.barrier()
    for copy in ("hsdp_resumed", "fsdp_to_hsdp"):
        runs[copy] = train(job(copy, *hsdp, "--checkpoint.load_step", "2"))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({k: {str(s): v for s, v in r.items()} for k, r in runs.items()}, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
