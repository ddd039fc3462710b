#!/usr/bin/env python3
"""The torchrun command of one Slurm node, built from the Slurm environment.

``train.sbatch`` runs this once per node (``srun --ntasks-per-node 1``); every node starts
``torchrun`` with the same c10d rendezvous on the job's first node, so the ranks of all nodes form
one job. Read from the environment:

- ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``): the nodes; the first is the rendezvous host
  unless ``MASTER_ADDR`` is set;
- ``SLURM_NNODES``, ``SLURM_NODEID``: node count and this node's index;
- ``SLURM_JOB_ID``: the rendezvous id (one per job, so a requeued job does not join an old one);
- ``NGPU`` (else ``SLURM_GPUS_ON_NODE``, else 8): ranks per node;
- ``MASTER_PORT`` (default 29500), ``LOG_RANK`` (default 0), ``CONFIG_FILE`` (default
  ``train_configs/dflash2_fp8.toml``).

Arguments are passed to the trainer (``--job.config_file`` on the command line wins over
``CONFIG_FILE``); ``--dry-run`` (first argument) prints the command instead of running it.

    python scripts/slurm/launch.py --dry-run --target.path /models/Qwen3-8B
"""

from __future__ import annotations

import os
import re
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list (``gpu-[01-03,07],login1``) as host names, in order."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"SLURM_JOB_NODELIST: cannot read range {r!r} in {nodelist!r}")
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{len(lo)}d}{suffix}")
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST: no hosts in {nodelist!r}")
    return hosts


def _int(env: dict, key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value in (None, ""):
        if default is None:
            raise ValueError(f"{key} is not set: run this under Slurm (sbatch/srun) or set it")
        return default
    # SLURM_GPUS_ON_NODE may read "4" or "h100:4"
    digits = value.rsplit(":", 1)[-1]
    if not digits.isdigit():
        raise ValueError(f"{key}: expected an integer, got {value!r}")
    return int(digits)


def build_command(env: dict, trainer_args: list[str]) -> list[str]:
    """``torchrun ... -m titan_draft.train ...`` for the node that ``env`` describes."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError("SLURM_JOB_NODELIST is not set: run this under Slurm (sbatch/srun) or set it")
    hosts = expand_nodelist(nodelist)
    nnodes = _int(env, "SLURM_NNODES", len(hosts))
    if nnodes != len(hosts):
        raise ValueError(f"SLURM_NNODES={nnodes} but SLURM_JOB_NODELIST names {len(hosts)} hosts")
    node_rank = _int(env, "SLURM_NODEID", 0)
    if not 0 <= node_rank < nnodes:
        raise ValueError(f"SLURM_NODEID={node_rank} is outside 0..{nnodes - 1}")
    nproc = _int(env, "NGPU", _int(env, "SLURM_GPUS_ON_NODE", 8))
    head = env.get("MASTER_ADDR") or hosts[0]
    port = _int(env, "MASTER_PORT", 29500)
    job_id = env.get("SLURM_JOB_ID", "titan_draft")
    config = [] if any(a.split("=")[0] in ("--job.config_file", "--job.config-file") for a in trainer_args) else [
        "--job.config_file", env.get("CONFIG_FILE", "train_configs/dflash2_fp8.toml")]
    return [
        "torchrun", f"--nnodes={nnodes}", f"--node_rank={node_rank}", f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d", f"--rdzv_endpoint={head}:{port}", f"--rdzv_id={job_id}",
        f"--local-ranks-filter={env.get('LOG_RANK', '0')}", "--role=rank", "--tee=3",
        "-m", "titan_draft.train", *config, *trainer_args,
    ]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    dry = bool(argv) and argv[0] == "--dry-run"
    if dry:
        argv = argv[1:]
    try:
        cmd = build_command(dict(os.environ), argv)
    except ValueError as e:
        print(f"slurm launch: {e}", file=sys.stderr)
        return 2
    if dry:
        print(shlex.join(cmd))
        return 0
    os.chdir(REPO)
    os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
