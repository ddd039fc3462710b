"""One trainer per dump folder: a live holder is refused by name, a dead one's lock is taken over."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import titan_draft.components.run_lock as run_lock
from titan_draft.components.run_lock import LOCK_FILE, RunLock, RunLockError
from titan_draft.config import ConfigManager
from titan_draft.train import Trainer
from helpers import REPO, job_args


def _holder(folder):
    """Another process that takes the lock of ``folder`` and keeps it until killed."""
    script = textwrap.dedent(f"""
        import sys, time
        from titan_draft.components.run_lock import RunLock
        lock = RunLock({str(folder)!r})
        lock.acquire()
        print("locked", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO})
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_trainer_is_refused_and_a_dead_holders_lock_taken_over(tmp_path, caplog, chat_jsonl, random_target_dir):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(RunLockError, match=rf"job.dump_folder {tmp_path} is in use by another trainer "
                                               rf"\(pid {proc.pid} on host .*\); stop it first"):
            RunLock(str(tmp_path)).acquire()
        # the trainer refuses before it loads anything
        with pytest.raises(RunLockError, match=f"pid {proc.pid}"):
            Trainer(ConfigManager().parse_args(job_args(tmp_path, chat_jsonl, random_target_dir)))
        assert not (tmp_path / "job_config.toml").exists()
    finally:
        proc.send_signal(signal.SIGKILL)  # dies holding it: the kernel drops the flock
        proc.wait()
    lock = RunLock(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        lock.acquire()
    assert f"taking over the stale lock of a trainer that is gone (pid {proc.pid} on host" in caplog.text
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    with pytest.raises(RunLockError):  # held now, even against this same process
        RunLock(str(tmp_path)).acquire()
    lock.release()
    caplog.clear()
    again = RunLock(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        again.acquire()  # a clean release leaves nothing stale
    again.release()
    assert "stale" not in caplog.text and not (tmp_path / LOCK_FILE).exists()  # a clean release leaves no file


def test_a_lock_released_while_another_trainer_opens_it_is_still_held_once(tmp_path, monkeypatch):
    """A clean release deletes the file: a trainer that opened it just before (and so locks the
    deleted file) must lock the path anew, or a third trainer would lock a new file of the same
    name and both would hold the folder."""
    first = RunLock(str(tmp_path))
    first.acquire()
    real_flock, calls = run_lock.fcntl.flock, []

    def release_first_then_flock(fd, op):
        calls.append(fd)
        if len(calls) == 1:  # the second trainer has the file open: the first one ends now
            first.release()
        return real_flock(fd, op)

    monkeypatch.setattr(run_lock.fcntl, "flock", release_first_then_flock)
    second = RunLock(str(tmp_path))
    second.acquire()
    monkeypatch.undo()
    assert len(calls) == 2  # it locked the deleted file, saw it, and locked the path again
    try:
        with pytest.raises(RunLockError, match=f"pid {os.getpid()}"):
            RunLock(str(tmp_path)).acquire()
    finally:
        second.release()
    assert not (tmp_path / LOCK_FILE).exists()


def test_without_flock_the_holders_pid_decides(tmp_path, monkeypatch, caplog):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_flock)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = {"pid": alive.pid, "host": run_lock.socket.gethostname(), "started": 0, "command": "x"}
        (tmp_path / LOCK_FILE).write_text(json.dumps(record))
        with pytest.raises(RunLockError, match=rf"may be in use by another trainer \(pid {alive.pid}"):
            RunLock(str(tmp_path)).acquire()
    finally:
        alive.kill()
        alive.wait()
    with caplog.at_level(logging.WARNING):
        lock = RunLock(str(tmp_path))
        lock.acquire()
    lock.release()
    assert "has no flock" in caplog.text and f"stale lock of a trainer that is gone (pid {alive.pid}" in caplog.text
