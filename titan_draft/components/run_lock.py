"""One trainer per dump folder: a lock that rank 0 holds for the run's lifetime.

A worker that outlived its launcher (a lost torchrun, a node that came back) would otherwise go on
training and writing checkpoints into the folder of the restarted job. The lock is an advisory
``flock`` on ``{dump_folder}/.titan_draft.lock``: the kernel releases it when its holder dies in
any way (kill -9 included), so a lock left by a dead process is never mistaken for a live one.
The file also names its holder (host, pid, start time, command); a second trainer refuses to
start with that line, and a trainer that finds the file naming a holder but the lock free says it
takes over a stale lock. A clean release deletes the file (a dump folder holds only results after
a run); it is deleted while still locked, and a trainer that got the lock checks that the path
still names the file it locked, else it starts over: otherwise one that opened the file just
before the deletion and a third one that creates a new file of the same name could both hold
"the" lock. A file left behind means its holder was killed; the next trainer names it.

Where the filesystem has no ``flock`` (some network filesystems), the holder's pid is checked
instead when it ran on this host, and the log says so.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time

logger = logging.getLogger(__name__)

LOCK_FILE = ".titan_draft.lock"


class RunLockError(RuntimeError):
    """Another live trainer holds the dump folder; the message names it."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("started", 0)))
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {started}: "
            f"{holder.get('command', '?')}")


class RunLock:
    """The dump folder's lock; :meth:`acquire` it once, :meth:`release` it at the end."""

    def __init__(self, dump_folder: str) -> None:
        self.dump_folder = dump_folder
        self.path = os.path.join(dump_folder, LOCK_FILE)
        self._file = None

    def _read_holder(self, f) -> dict:
        f.seek(0)
        try:
            return json.loads(f.read() or "{}")
        except ValueError:
            return {}

    def acquire(self) -> None:
        """Take the lock or raise :class:`RunLockError` naming the live holder."""
        os.makedirs(self.dump_folder, exist_ok=True)
        while True:
            f = open(self.path, "a+")
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                flock = True
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    holder = self._read_holder(f)
                    f.close()
                    raise RunLockError(
                        f"job.dump_folder {self.dump_folder} is in use by another trainer ({_describe(holder)}); "
                        f"stop it first, or give this job another job.dump_folder") from None
                flock = False
                logger.warning("run lock: %s has no flock (%s); checking the holder's pid instead", self.path, e)
            if not flock or self._still_named(f):
                break
            f.close()  # its holder deleted it on release before we locked it: lock the path anew
        holder = self._read_holder(f)
        if holder:
            same_host = holder.get("host") == socket.gethostname()
            if not flock and (not same_host or _pid_alive(int(holder.get("pid", -1)))):
                f.close()
                raise RunLockError(
                    f"job.dump_folder {self.dump_folder} may be in use by another trainer ({_describe(holder)}) "
                    f"and this filesystem cannot tell: stop it, or delete {self.path} if it is gone")
            logger.warning("run lock: taking over the stale lock of a trainer that is gone (%s)", _describe(holder))
        try:
            f.seek(0)
            f.truncate()
            f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                "command": " ".join(sys.argv)[:500]}))
            f.flush()
            os.fsync(f.fileno())
        except OSError:
            # e.g. a full disk: leave no empty lock file behind (it is ours while we hold the flock)
            self._file = f
            self.release()
            raise
        self._file = f

    def _still_named(self, f) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            return False

    def release(self) -> None:
        if self._file is None:
            return
        f, self._file = self._file, None
        try:
            os.unlink(self.path)  # while still locked (see the module docstring)
        except FileNotFoundError:
            pass
        finally:
            f.close()  # closing drops the flock


def maybe_acquire_run_lock(dump_folder: str, is_rank0: bool) -> RunLock | None:
    """Rank 0 locks the dump folder (see the module docstring); other ranks get None."""
    if not is_rank0:
        return None
    lock = RunLock(dump_folder)
    lock.acquire()
    return lock
