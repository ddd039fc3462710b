"""scripts/slurm: the torchrun command each Slurm node runs, read from the Slurm environment;
the sbatch script's wiring through a stand-in srun; and the command itself training on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys

import pytest
from helpers import REPO

SCRIPT = os.path.join(REPO, "scripts", "slurm", "launch.py")
_spec = importlib.util.spec_from_file_location("slurm_launch", SCRIPT)
launch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(launch)


@pytest.mark.parametrize("nodelist,hosts", [
    ("node1", ["node1"]),
    ("gpu-[01-03,07]", ["gpu-01", "gpu-02", "gpu-03", "gpu-07"]),
    ("a[8-10],b5,c[1]", ["a8", "a9", "a10", "b5", "c1"]),
    ("rack1-n[001-002]-ib", ["rack1-n001-ib", "rack1-n002-ib"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert launch.expand_nodelist(nodelist) == hosts


ENV = {"SLURM_JOB_NODELIST": "gpu-[01-02,07]", "SLURM_NNODES": "3", "SLURM_NODEID": "2",
       "SLURM_JOB_ID": "4242", "SLURM_GPUS_ON_NODE": "h100:4"}


def _flags(cmd: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in cmd if a.startswith("--") and "=" in a)


def test_command_from_the_slurm_environment():
    cmd = launch.build_command(ENV, ["--target.path", "/models/Qwen3-8B"])
    f = _flags(cmd)
    assert cmd[0] == "torchrun" and (f["nnodes"], f["node_rank"], f["nproc_per_node"]) == ("3", "2", "4")
    assert (f["rdzv_backend"], f["rdzv_endpoint"], f["rdzv_id"]) == ("c10d", "gpu-01:29500", "4242")
    assert cmd[cmd.index("-m") + 1:] == ["titan_draft.train", "--job.config_file", "train_configs/dflash2_fp8.toml",
                                          "--target.path", "/models/Qwen3-8B"]
    # NGPU, MASTER_ADDR/PORT and CONFIG_FILE override; a --job.config_file argument wins over CONFIG_FILE
    env = dict(ENV, NGPU="2", MASTER_ADDR="10.0.0.9", MASTER_PORT="31000", CONFIG_FILE="x.toml")
    f = _flags(launch.build_command(env, []))
    assert (f["nproc_per_node"], f["rdzv_endpoint"]) == ("2", "10.0.0.9:31000")
    assert "x.toml" in launch.build_command(env, [])
    cmd = launch.build_command(env, ["--job.config_file", "y.toml"])
    assert "x.toml" not in cmd and cmd.count("--job.config_file") == 1


@pytest.mark.parametrize("change,message", [
    ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is not set"),
    ({"SLURM_NNODES": "2"}, "SLURM_NNODES=2 but SLURM_JOB_NODELIST names 3 hosts"),
    ({"SLURM_NODEID": "3"}, "SLURM_NODEID=3 is outside 0..2"),
    ({"NGPU": "four"}, "NGPU: expected an integer"),
    ({"SLURM_JOB_NODELIST": "gpu-[a-b]"}, "cannot read range"),
])
def test_bad_environment_is_one_line(change, message):
    env = {k: v for k, v in {**ENV, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        launch.build_command(env, [])


def test_sbatch_runs_one_launcher_per_node_in_dry_run(tmp_path):
    """train.sbatch under a stand-in srun that starts the task once per node, as Slurm would:
    every node prints its own torchrun command, all with one rendezvous."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(
        "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        "for i in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$i \"$@\" || exit $?; done\n")
    (fake / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(ENV, PATH=f"{fake}:{env['PATH']}", DRY_RUN="1", SLURM_SUBMIT_DIR=REPO)
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "slurm", "train.sbatch"), "--training.steps", "3"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    ranks = [_flags(shlex.split(line))["node_rank"] for line in lines]
    assert ranks == ["0", "1", "2"]
    assert {_flags(shlex.split(line))["rdzv_endpoint"] for line in lines} == {"gpu-01:29500"}
    assert all(line.endswith("--training.steps 3") for line in lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_command_trains_one_node_on_cpu(tmp_path, random_target_dir, chat_jsonl):
    """The launcher's own torchrun command (one node, two gloo ranks) runs the trainer to its end."""
    env = dict(os.environ, SLURM_JOB_NODELIST="localhost", SLURM_NNODES="1", SLURM_NODEID="0",
               SLURM_JOB_ID="t", NGPU="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    dump = tmp_path / "run"
    args = ["--job.config_file", os.path.join(REPO, "train_configs", "debug_random.toml"),
            "--job.dump_folder", str(dump), "--target.path", random_target_dir, "--data.source", chat_jsonl,
            "--training.steps", "2", "--checkpoint.interval", "2", "--metrics.enable_tensorboard", "false",
            "--profiling.enable_profiling", "false", "--eval.enable", "false"]
    cmd = launch.build_command(env, args)
    cmd[0:1] = [sys.executable, "-m", "torch.distributed.run"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    info = json.loads((dump / "run_info.json").read_text())
    assert info["world_size"] == 2 and (dump / "checkpoint" / "step-2").is_dir()
