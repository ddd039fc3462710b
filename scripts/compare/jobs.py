"""Running the jobs of scripts/compare_drafts.py and scripts/sweep_decode.py: each job's output
appended to its own log, Ctrl-C shared with the job and waited for, the comparison's log, and the
stage records, each written whole or not at all."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import time

from scripts.compare.runs import REPO, CompareError
from titan_draft.components.disk_full import write_atomic

LOG_PATH: list[str] = []  # <out>/compare.log once the out folder is known


def log_line(line: str) -> None:
    line = f"[{datetime.datetime.now():%H:%M:%S}] {line}"
    print(line, flush=True)
    if LOG_PATH:
        with open(LOG_PATH[0], "a") as f:
            f.write(line + "\n")


class Interrupted(CompareError):
    """Ctrl-C during a job; ``wall_s``: how long the job ran."""

    def __init__(self, wall_s: float):
        super().__init__("interrupted: the running job stopped (a training job saves a checkpoint first); run the "
                         "same command again to continue", status=130)
        self.wall_s = wall_s


def run_logged(cmd: list[str], log_path: str, env_extra: dict | None = None) -> tuple[int, float]:
    """Run ``cmd`` from the repository root, its output appended to ``log_path``; (exit status,
    wall seconds). Ctrl-C reaches the job too (same process group): it saves and exits, and this
    waits for that instead of killing it mid-save, then raises :class:`Interrupted`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
           **(env_extra or {})}
    with open(log_path, "a") as log:
        log.write(f"$ {shlex.join(cmd)}\n")
        log.flush()
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        interrupted = False
        while True:
            try:
                rc = proc.wait()
                break
            except KeyboardInterrupt:  # the job has the signal too (a second one: it stops at once)
                interrupted = True
    wall = time.monotonic() - start
    if interrupted:
        raise Interrupted(wall)
    return rc, wall


def last_line(log_path: str) -> str:
    with open(log_path, errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    return lines[-1] if lines else "(no output)"


def read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_json(path: str, value: dict) -> None:
    write_atomic(path, json.dumps(value, indent=2))  # a stage's record is whole or absent


def portable(value):
    """A recorded value as it reads on any checkout: an absolute path inside this repository
    (a recipe, a target under outputs/) relative to it, in a list too. A comparison's folders
    gathered from machines whose checkouts lie elsewhere then hold the same records."""
    if isinstance(value, list):
        return [portable(v) for v in value]
    if isinstance(value, str) and os.path.isabs(value):
        rel = os.path.relpath(value, REPO)
        if rel != os.pardir and not rel.startswith(os.pardir + os.sep):
            return rel
    return value


def portable_record(settings: dict) -> dict:
    return {k: portable(v) for k, v in settings.items()}


def changed_settings(path: str, settings: dict) -> list[str]:
    """The keys in which ``settings`` differ from those recorded at ``path`` (recorded if none are),
    paths compared as :func:`portable` reads them (a record of this checkout's absolute paths too)."""
    old = read_json(path)
    if old is None:
        write_json(path, portable_record(settings))
        return []
    return settings_changes(old, settings)


def settings_changes(recorded: dict, settings: dict) -> list[str]:
    """The keys in which a recorded settings file and ``settings`` differ, paths read as
    :func:`portable` reads them."""
    return differing_keys(portable_record(recorded), portable_record(settings))


def differing_keys(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
