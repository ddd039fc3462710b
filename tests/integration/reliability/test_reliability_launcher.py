"""run_train.sh owns its run: the ranks stop (and save) when the script dies or its terminal
closes, the trainer's exit status comes through, and every end has its reason as the last line.

Most tests run the real script under the real torchrun with a stand-in trainer (a copy of the
script beside a ``titan_draft/train.py`` of a few lines): torchrun's report and process tree are
the real ones, and a test takes seconds, not a training run.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import REPO, job_args

# The stand-in rank. kill: rank FAKE_KILLED_RANK dies of SIGKILL (what the OOM killer does), the
# others serve. exit2: a job error.
# serve: holds a lock as the trainer holds the dump folder's, and on SIGTERM "saves" (a second
# later, counting the SIGTERMs it got) and exits 0. starting: a rank still starting Python, which
# a SIGTERM kills.
FAKE_TRAINER = textwrap.dedent("""
    import fcntl, json, os, signal, sys, time
    mode, out = os.environ["FAKE_MODE"], os.environ["FAKE_OUT"]
    if mode == "kill" and os.environ["RANK"] == os.environ.get("FAKE_KILLED_RANK", "0"):
        print("rank: training", file=sys.stderr, flush=True)
        time.sleep(float(os.environ.get("FAKE_KILL_AFTER", "0")))
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exit2":
        print("titan_draft: error: model.flavor: 'huge' is not a flavor", file=sys.stderr, flush=True)
        sys.exit(2)
    if mode == "starting":
        print("rank: starting", file=sys.stderr, flush=True)
        time.sleep(60)
        sys.exit(3)
    out = os.path.join(out, os.environ["RANK"]) if os.environ["WORLD_SIZE"] != "1" else out
    os.makedirs(out, exist_ok=True)
    lock = open(os.path.join(out, "lock"), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    with open(os.path.join(out, "pids.json"), "w") as f:
        json.dump({"rank": os.getpid(), "torchrun": os.getppid()}, f)
    got = []
    def stop(signum, frame):
        got.append(signum)
        if len(got) > 1:
            return
        os.write(2, b"rank: got SIGTERM, saving\\n")  # not print: it may interrupt one
        time.sleep(1.5)
        with open(os.path.join(out, "saved.tmp"), "w") as f:  # then renamed: the test polls for "saved"
            f.write(str(len(got)))
        os.replace(os.path.join(out, "saved.tmp"), os.path.join(out, "saved"))
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print("rank: training", file=sys.stderr, flush=True)
    time.sleep(60)
    sys.exit(3)
""")


@pytest.fixture
def launcher(tmp_path):
    """A copy of run_train.sh whose ``-m titan_draft.train`` is the stand-in; returns
    (its folder, the env to run it with)."""
    root = tmp_path / "repo"
    (root / "titan_draft").mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "run_train.sh"), root / "run_train.sh")
    (root / "titan_draft" / "__init__.py").write_text("")
    (root / "titan_draft" / "train.py").write_text(FAKE_TRAINER)
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "tmp").mkdir()
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "NGPU": "1", "HOME": str(tmp_path),
           "FAKE_OUT": str(out), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path / "tmp")}
    return root, env


def _run(root, env, mode, **extra):
    proc = subprocess.run(["./run_train.sh"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={**env, "FAKE_MODE": mode, **extra})
    return proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()


def test_a_rank_killed_by_a_signal_is_named_in_the_last_line(launcher):
    rc, lines = _run(*launcher, "kill")
    assert rc == 128 + signal.SIGKILL, lines
    assert not list((launcher[0].parent / "tmp").glob("titan_draft_*"))
    assert lines[-1].startswith("titan_draft: error: rank 0 was killed by SIGKILL (when nobody sent it, "
                                "SIGKILL is most often the kernel's out-of-memory killer"), lines
    assert not any("ChildFailedError" in line or "Traceback" in line for line in lines), lines


def test_of_two_ranks_the_killed_one_is_named(launcher):
    """Rank 1 is killed; torchrun then stops rank 0 (which saves): the line names rank 1."""
    rc, lines = _run(*launcher, "kill", NGPU="2", LOG_RANK="0,1", FAKE_KILLED_RANK="1", FAKE_KILL_AFTER="2")
    assert rc == 128 + signal.SIGKILL, lines
    assert lines[-1].startswith("titan_draft: error: rank 1 was killed by SIGKILL ("), lines
    assert (launcher[0].parent / "out" / "0" / "saved").exists(), lines


def test_the_trainers_exit_status_comes_through(launcher):
    rc, lines = _run(*launcher, "exit2")
    assert rc == 2, lines  # torchrun itself exits 1
    assert lines[-1] == "[rank0]:titan_draft: error: model.flavor: 'huge' is not a flavor", lines


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) holds nothing
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _wait_for(path, timeout=30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    return os.path.exists(path)


def _check_the_run_ended(out, pids, expect_terms=1):
    """The rank saved (after exactly ``expect_terms`` SIGTERMs), and neither it nor torchrun is
    left, so the lock is free."""
    try:
        assert _wait_for(out / "saved"), "the rank was never asked to stop"
        assert (out / "saved").read_text() == str(expect_terms)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids.values()), pids
        with open(out / "lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if a process still holds it
        deadline = time.monotonic() + 10  # the script's temporary file goes too, once torchrun is gone
        while list((out.parent / "tmp").glob("titan_draft_*")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list((out.parent / "tmp").glob("titan_draft_*"))
    finally:
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _read_until(fd, marker: str, timeout=60.0) -> str:
    seen, deadline = "", time.monotonic() + timeout
    while marker not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            seen += chunk.decode(errors="replace")
    assert marker in seen, seen
    return seen


# a session of its own whose controlling terminal is the pty on stdin, as a terminal window's shell
# has; closing the pty's other end then hangs up the session
IN_A_TERMINAL = ["setsid", "--ctty"]


def _hangup_as_in_a_terminal() -> None:
    """A terminal's shell starts its jobs with SIGHUP at its default. A test run started under
    nohup (or anything else that ignores SIGHUP) would hand the ignore down to run_train.sh, which
    a shell can neither trap nor reset, and the hangup under test would never arrive."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_closing_the_terminal_stops_the_ranks_and_frees_the_lock(launcher):
    """run_train.sh in the foreground of a real terminal (a pty, its controlling terminal); the
    terminal closes (SIGHUP to the session): the ranks, in torchrun's own session, still get
    their SIGTERM, save and exit, and torchrun with them."""
    root, env = launcher
    out = root.parent / "out"
    master, slave = os.openpty()
    proc = subprocess.Popen([*IN_A_TERMINAL, "./run_train.sh"], cwd=root, stdin=slave, stdout=slave, stderr=slave,
                            env={**env, "FAKE_MODE": "serve"}, preexec_fn=_hangup_as_in_a_terminal)
    os.close(slave)
    try:
        _read_until(master, "rank: training")
        pids = json.loads((out / "pids.json").read_text())
    finally:
        os.close(master)  # the terminal goes away: the kernel hangs up its session
    proc.wait(timeout=30)
    _check_the_run_ended(out, pids)


@pytest.mark.parametrize("first_sigterm", [False, True], ids=["kill9", "sigterm_then_kill9"])
def test_sigkill_of_the_script_stops_the_ranks(launcher, first_sigterm):
    """kill -9 of run_train.sh: the ranks get one SIGTERM (they save) and end, with torchrun.
    After a SIGTERM the script already forwarded, they get no second one (which would mean
    "exit now", cutting the save short)."""
    root, env = launcher
    out = root.parent / "out"
    proc = subprocess.Popen(["./run_train.sh"], cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, env={**env, "FAKE_MODE": "serve"})
    try:
        _read_until(proc.stderr.fileno(), "rank: training")
        pids = json.loads((out / "pids.json").read_text())
        if first_sigterm:
            proc.send_signal(signal.SIGTERM)
            _read_until(proc.stderr.fileno(), "rank: got SIGTERM")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.stderr.close()
    _check_the_run_ended(out, pids)


def test_a_stop_while_a_rank_starts_python_exits_0_saying_so(launcher):
    """A rank that a forwarded SIGTERM kills before it could handle it (still starting Python)
    stopped as asked: exit 0, and the last line says nothing was saved."""
    root, env = launcher
    proc = subprocess.Popen(["./run_train.sh"], cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env={**env, "FAKE_MODE": "starting"})
    lines = []
    for line in proc.stderr:
        lines.append(line.strip())
        if "rank: starting" in line:
            proc.send_signal(signal.SIGTERM)
            break
    lines += [line.strip() for line in proc.stderr]
    assert proc.wait(timeout=60) == 0, lines
    assert lines[-1] == ("titan_draft: stopped by SIGTERM during start-up, before training began: nothing new "
                         "was saved; run the same command again to start (or resume)"), lines


def test_help_is_printed_directly():
    env = {"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "HOME": REPO, "PYTHONPATH": REPO}
    proc = subprocess.run(["./run_train.sh", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert any(line.lstrip().startswith("--job.dump_folder") for line in lines), lines[:20]
    assert not any(line.startswith("[rank") for line in lines + proc.stderr.splitlines()), lines[:5]


def test_a_stop_during_the_trainers_start_up_exits_0(tmp_path, chat_jsonl, random_target_dir):
    """SIGTERM while the trainer starts (the target loads): no traceback, exit 0, the reason as
    the last line."""
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from titan_draft.cli import run_cli

        def build(cfg):  # the target load, interrupted
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            print("not reached", flush=True)

        run_cli(build, {job_args(tmp_path, chat_jsonl, random_target_dir)!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    assert "not reached" not in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "titan_draft: stopped by SIGTERM during start-up, before training began: nothing new was saved; "
        "run the same command again to start (or resume)"), proc.stderr


def test_closing_the_terminal_of_a_real_run_saves_it(tmp_path, chat_jsonl, random_target_dir):
    """The tiny debug job through run_train.sh in a terminal that closes mid-run: the trainer
    saves its step, nothing of the run is left running and the dump folder is free."""
    dump = tmp_path / "run"
    argv = job_args(dump, chat_jsonl, random_target_dir, "--training.steps", "500", "--checkpoint.interval", "1000")
    master, slave = os.openpty()
    proc = subprocess.Popen([*IN_A_TERMINAL, "./run_train.sh", *argv], cwd=REPO, stdin=slave, stdout=slave,
                            stderr=slave, preexec_fn=_hangup_as_in_a_terminal,
                            env={"PATH": f"{os.path.dirname(sys.executable)}:/usr/bin:/bin", "PYTHONPATH": REPO,
                                 "NGPU": "1", "HOME": str(tmp_path), "OMP_NUM_THREADS": "1"})
    os.close(slave)
    try:
        try:
            _read_until(master, " step 2/500 ", timeout=120)
        finally:
            os.close(master)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while subprocess.run(["pgrep", "-f", str(dump)], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "the run is still running after its terminal closed"
            time.sleep(0.2)
    finally:
        subprocess.run(["pkill", "-KILL", "-f", str(dump)], check=False)
    steps = [p.name for p in (dump / "checkpoint").iterdir() if (p / ".metadata").exists()]
    assert steps, "the stopped run saved no checkpoint"
    assert not (dump / "export").exists()  # stopped, not finished
    assert not (dump / ".titan_draft.lock").exists()
