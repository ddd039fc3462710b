"""Running the real Trainer from a test: a draft's debug job as argv, run to the end or killed
right after a checkpoint, and the kill-and-resume check every draft's e2e test makes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Draft -> its debug job. A draft registered without an entry here uses train_configs/<name>_debug.toml.
DEBUG_CONFIGS = {"dflash2": "debug_random.toml", "eagle3": "eagle3_debug.toml"}


def debug_config(draft: str) -> str:
    path = os.path.join(REPO, "train_configs", DEBUG_CONFIGS.get(draft, f"{draft}_debug.toml"))
    assert os.path.isfile(path), f"no debug job for draft {draft!r}: add it to tests/trainer_runs.DEBUG_CONFIGS"
    return path


def debug_job_argv(draft: str, dump, target: str, data: str, *extra: str, max_length: int = 96) -> list[str]:
    """``draft``'s debug job against ``target`` on ``data``, written to ``dump``: rows cut to
    ``max_length``, every step logged, no TensorBoard, no profiler; ``extra`` overrides any of it."""
    return ["--job.config_file", debug_config(draft), "--job.dump_folder", str(dump), "--target.path", target,
            "--data.source", data, "--data.max_length", str(max_length), "--metrics.log_freq", "1",
            "--metrics.enable_tensorboard", "false", "--profiling.enable_profiling", "false", *extra]


def torchrun(nprocs: int, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run ... args`` on ``nprocs`` local ranks from the repo root,
    output captured: one thread per rank (the CPU has few cores), the repo importable, and
    faulthandler on, so a rank's native abort prints its Python stacks into the output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs), "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_training(argv: list[str], crash_after_step: int | None = None,
                 keep_process_group: bool = False) -> dict[int, float]:
    """Train the job of ``argv``; the global loss of every logged step. With
    ``crash_after_step`` the run dies (KeyboardInterrupt) right after saving that step.
    ``keep_process_group``: leave torch.distributed up for the next run (several jobs in one
    torchrun launch)."""
    trainer = Trainer(ConfigManager().parse_args(argv))
    if crash_after_step is not None:
        save = trainer.checkpointer.save

        def save_then_die(step, **kw):
            save(step, **kw)
            if step == crash_after_step:
                raise KeyboardInterrupt("simulated kill")

        trainer.checkpointer.save = save_then_die
    try:
        return trainer.train()
    finally:
        trainer.close()
        if not keep_process_group:
            destroy_distributed()


def check_exact_resume(argv_of: Callable[[Path], list[str]], root: Path, kill_after: int = 3,
                       before_resume: Callable[[Path], None] | None = None) -> dict[int, float]:
    """Train ``argv_of(root / "full")`` to the end; train ``argv_of(root / "killed")``, killed right
    after saving step ``kill_after``, then again (``before_resume(root / "killed")`` in between):
    the resumed run must log exactly the remaining steps, each with the uninterrupted run's loss.
    Returns the uninterrupted run's losses."""
    full = run_training(argv_of(root / "full"))
    with pytest.raises(KeyboardInterrupt):
        run_training(argv_of(root / "killed"), crash_after_step=kill_after)
    if before_resume is not None:
        before_resume(root / "killed")
    resumed = run_training(argv_of(root / "killed"))
    assert sorted(resumed) == list(range(kill_after + 1, max(full) + 1)), sorted(resumed)
    for step in resumed:
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step
    return full
