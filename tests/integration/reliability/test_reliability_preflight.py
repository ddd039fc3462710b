"""Job mistakes that need no target weights are one line, exit 2, before the target loads."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

import titan_draft.train as train_module
from helpers import REPO, job_args, main_error


@pytest.mark.parametrize("extra, expected", [
    (("--data.source", "/no/such/data.jsonl"), "data.source: '/no/such/data.jsonl' does not exist"),
    (("--model.flavor", "huge"), "model.flavor: 'huge' is not a dflash2 flavor"),
    (("--model.name", "nope"), "unknown model.name 'nope'; registered drafts: ['dflash2', 'dspark', 'eagle3'"),
    (("--model.args.no_such_arg", "1"), "model.args: unknown dflash2 arg(s) ['no_such_arg']"),
    (("--target.capture_layers", "1,6"), "target.capture_layers: [6] out of range: "),
    (("--data.max_length", "8"), "data.source: none of the first 200 rows of "),
], ids=["missing_source", "flavor", "draft", "draft_arg", "capture_layer", "max_length"])
def test_checked_before_the_target_loads(capsys, no_trainer, chat_jsonl, random_target_dir, tmp_path, extra, expected):
    line = main_error(capsys, job_args(tmp_path, chat_jsonl, random_target_dir, *extra))
    assert line.startswith(expected), line
    if extra[0] == "--data.max_length":
        assert "is usable with data.max_length = 8: skipped {'no_loss_tokens': 194, " in line
        assert line.endswith("(a longer data.max_length keeps the answers)")
    if extra[0] == "--target.capture_layers":
        assert line.endswith("has 6 decoder layers (ids 0..5)")


def test_a_good_job_passes_the_checks(no_trainer, chat_jsonl, random_target_dir, tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO), pytest.raises(AssertionError, match="the target started loading"):
        train_module.main(job_args(tmp_path, chat_jsonl, random_target_dir))
    # a first line says what is happening before the (possibly long) target load
    assert f"-> {tmp_path}: checking it, then loading the target {random_target_dir}" in caplog.records[0].getMessage()


def test_run_train_sh_shows_the_trainers_line_without_torchruns_report(tmp_path, chat_jsonl, random_target_dir):
    env_path = f"{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin"
    proc = subprocess.run(["./run_train.sh", *job_args(tmp_path, chat_jsonl, random_target_dir, "--model.flavor", "huge")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PATH": env_path, "PYTHONPATH": REPO, "NGPU": "1", "HOME": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr[-2000:]  # the trainer's status for a wrong job, not torchrun's 1
    out = (proc.stdout + proc.stderr).strip().splitlines()
    assert "titan_draft: error: model.flavor: 'huge' is not a dflash2 flavor (" in out[-1], out  # the last line
    text = proc.stdout + proc.stderr
    assert "ChildFailedError" not in text and "Traceback" not in text and "Root Cause" not in text, text


# an awk whose `-W version` goes on writing after its first line (as a slow or loaded machine can
# make the real one do): a `awk -W version | grep -q mawk` check then sees awk die of SIGPIPE
SLOW_VERSION_AWK = """#!/usr/bin/env bash
if [ "$*" = "-W version" ]; then echo "mawk 1.3.4"; sleep 0.3; echo "more"; echo "more"; exit 0; fi
exec {awk} "$@"
"""


@pytest.mark.parametrize("awk", ["system", "slow_version"])
def test_run_train_sh_passes_log_lines_on_as_they_come(tmp_path, awk):
    """The stderr filter must not hold lines back (mawk reads pipes in blocks by default): a
    line the launcher writes reaches the terminal before the launcher's next one, seconds later,
    also when awk's version check is slow to finish."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text("#!/usr/bin/env bash\necho first >&2\nsleep 3\necho second >&2\n")
    (fake / "torchrun").chmod(0o755)
    if awk == "slow_version":
        real = shutil.which("awk", path="/usr/bin:/bin")
        version = subprocess.run([real, "-W", "version"], capture_output=True, text=True).stdout
        if "mawk" not in version:
            pytest.skip(f"the system awk ({real}) is not mawk: nothing to hold lines back")
        (fake / "awk").write_text(SLOW_VERSION_AWK.format(awk=real))
        (fake / "awk").chmod(0o755)
    proc = subprocess.Popen(["./run_train.sh"], cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, env={"PATH": f"{fake}:/usr/bin:/bin", "NGPU": "1", "HOME": str(tmp_path)})
    seen = []
    for line in proc.stderr:
        seen.append((line.strip(), time.monotonic()))
    assert proc.wait(timeout=30) == 0
    (first, t1), (second, t2) = [s for s in seen if s[0] in ("first", "second")]
    assert (first, second) == ("first", "second") and t2 - t1 > 2.0, seen


FAKE_TORCHRUN = """#!/usr/bin/env bash
# stand-in: a launcher that fails if a stop signal reaches it, with one rank that saves and exits 0
trap 'echo "launcher got a signal" >&2; exit 1' TERM INT
python3 -c '
import os, signal, sys, time
def stop(*_):  # os.write: the signal may come while print still flushes "rank: training"
    os.write(2, b"rank: step finished, checkpoint saved\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("rank: training", file=sys.stderr, flush=True)
time.sleep(60)
sys.exit(3)
' &
rank=$!
while kill -0 $rank 2>/dev/null; do sleep 0.1; done
wait $rank
"""


def _run_train_sh_until(tmp_path, launcher: str, line_start: str):
    """./run_train.sh with ``launcher`` as its torchrun, read until a stderr line starts with
    ``line_start``; returns the process and the lines so far."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text(launcher)
    (fake / "torchrun").chmod(0o755)
    proc = subprocess.Popen(["./run_train.sh"], cwd=REPO, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            text=True, start_new_session=True,
                            env={"PATH": f"{fake}:{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin", "NGPU": "1",
                                 "HOME": str(tmp_path)})
    lines = []
    for line in proc.stderr:
        lines.append(line.strip())
        if line.startswith(line_start):
            break
    return proc, lines


@pytest.mark.parametrize("how", ["kill", "ctrl-c"])
def test_run_train_sh_stop_signal_reaches_the_ranks_and_exits_0(tmp_path, how):
    """SIGTERM to run_train.sh (Kubernetes, kill) or Ctrl-C (SIGINT to its whole process group)
    reaches the ranks, not torchrun: the rank saves and exits 0, and so does the script."""
    proc, lines = _run_train_sh_until(tmp_path, FAKE_TORCHRUN, "rank: training")
    if how == "kill":
        proc.send_signal(signal.SIGTERM)
    else:
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
    lines += [line.strip() for line in proc.stderr]
    assert proc.wait(timeout=30) == 0, lines
    assert "rank: step finished, checkpoint saved" in lines, lines
    assert "launcher got a signal" not in lines, lines


# stand-in: a launcher that takes a while before it starts its rank (torchrun's rendezvous),
# without a child process meanwhile, then starts the rank above
SLOW_TORCHRUN = FAKE_TORCHRUN.replace("python3 -c", """echo "launcher: starting" >&2
SECONDS=0; while [ $SECONDS -lt 2 ]; do :; done
python3 -c""", 1)


def test_a_stop_before_the_ranks_exist_reaches_them_once_they_do(tmp_path):
    """SIGTERM while torchrun is still starting (no rank to forward it to yet) is not lost: it is
    sent to the ranks as soon as they exist, and the job stops instead of training on."""
    proc, lines = _run_train_sh_until(tmp_path, SLOW_TORCHRUN, "launcher: starting")
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    lines += [line.strip() for line in proc.stderr]
    rc = proc.wait(timeout=30)
    # the rank either saved (its handler was installed) or, hit while Python was still starting,
    # died of the signal; it never sleeps its 60 s out and exits 3 as an unstopped run would
    assert time.monotonic() - t0 < 30 and rc in (0, 128 + signal.SIGTERM), (rc, lines)
    assert rc != 0 or "rank: step finished, checkpoint saved" in lines, lines
    assert "launcher got a signal" not in lines, lines


def test_run_train_sh_sigterm_under_real_torchrun_saves_and_exits_0(tmp_path, chat_jsonl, random_target_dir):
    """The same with torchrun and the trainer: the run stops after a step with a checkpoint,
    the line saying where to resume, and exit status 0 (torchrun itself exits non-zero when the
    signal reaches it)."""
    env_path = f"{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin"
    dump = tmp_path / "run"
    proc = subprocess.Popen(["./run_train.sh", *job_args(dump, chat_jsonl, random_target_dir, "--training.steps", "500",
                                                         "--checkpoint.interval", "1000")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True,
                            env={"PATH": env_path, "PYTHONPATH": REPO, "NGPU": "1", "HOME": str(tmp_path)})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip() for line in proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any(" step 3/500 " in line for line in list(lines)) and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
    finally:
        # without the fix torchrun outlives the script, in the script's process group; with it,
        # torchrun has its own session: whatever still runs this job goes
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-KILL", "-f", str(dump)], check=False)
    reader.join(timeout=10)
    assert rc == 0, lines[-20:]
    assert any("stopped by SIGTERM after step" in line and "saved" in line for line in lines), lines[-20:]
    assert any(p.name.startswith("step-") for p in (dump / "checkpoint").iterdir())
    assert not (dump / "export").exists()  # a half-trained draft is not exported
    assert not (dump / ".titan_draft.lock").exists()  # released and removed: nothing holds the folder
