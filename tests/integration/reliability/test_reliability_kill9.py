"""Repeated kill -9, at a random step and in the middle of a checkpoint save: the run that finally
completes logs the same losses as an uninterrupted one."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO, job_args, run_training

STEPS = 8
COMMON = ("--training.steps", str(STEPS), "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2")

# Runs the real trainer and SIGKILLs itself: at the start of step `kill_step` (while the target
# runs), or, with `in_save`, while DCP flushes a shard of that step's checkpoint (no .metadata yet).
_DRIVER = textwrap.dedent("""
    import json, os, signal, sys
    import titan_draft.train as train_module
    from titan_draft.config import ConfigManager
    kill_step, in_save, argv = int(sys.argv[1]), sys.argv[2] == "save", sys.argv[3:]
    trainer = train_module.Trainer(ConfigManager().parse_args(argv))
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    if in_save:
        real_fsync = os.fsync
        def fsync(fd):
            if trainer.train_state.step == kill_step and os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
                die()
            return real_fsync(fd)
        os.fsync = fsync
    else:
        real = trainer.features_fn
        def hooked(*a, **k):
            if trainer.train_state.step == kill_step:
                die()
            return real(*a, **k)
        trainer.features_fn = hooked
    losses = trainer.train()
    print("LOSSES " + json.dumps(losses))
""")


def _run(argv, kill_step, in_save):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
    return subprocess.run([sys.executable, "-c", _DRIVER, str(kill_step), "save" if in_save else "step", *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_repeated_kill_9_resumes_exactly(tmp_path, chat_jsonl, random_target_dir):
    import json

    full = run_training(job_args(tmp_path / "full", chat_jsonl, random_target_dir, *COMMON))
    kill_step = random.Random(14).randrange(3, 5)  # a random step after the first checkpoint
    argv = job_args(tmp_path / "killed", chat_jsonl, random_target_dir, *COMMON)
    for step, in_save in [(kill_step, False), (6, True)]:  # then inside step 6's save
        proc = _run(argv, step, in_save)
        assert proc.returncode == -signal.SIGKILL, (step, in_save, proc.stderr[-3000:])
    assert not os.path.isfile(tmp_path / "killed" / "checkpoint" / "step-6" / ".metadata")
    proc = _run(argv, STEPS + 10, False)  # never reached: runs to the end
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {int(k): v for k, v in json.loads(proc.stdout.split("LOSSES ", 1)[1]).items()}
    assert sorted(losses) == [5, 6, 7, 8], proc.stderr[-2000:]
    assert "skipping incomplete checkpoint(s) without .metadata" in proc.stderr and "step-6" in proc.stderr
    for step, loss in losses.items():
        assert loss == pytest.approx(full[step], rel=1e-5, abs=1e-6), step
    assert max(losses) == STEPS and os.path.isfile(tmp_path / "killed" / "export" / "model.safetensors")
