"""Recognizing a full disk wherever it surfaces, and saying it in one line.

ENOSPC reaches the trainer in several disguises: a plain ``OSError`` (run lock, JSON files,
TensorBoard's writer thread re-raising on the next write), torch's zip writer's ``RuntimeError:
[enforce fail at inline_container.cc:...]`` (a ``torch.save`` inside DCP; the errno is lost, only
the text remains), safetensors' ``SafetensorError`` (the errno survives only in its message), and
DCP's ``CheckpointException`` holding one of those per rank. Every site asks :func:`is_disk_full`
and says :func:`disk_full_line`, so all of them read the same:
``disk full on <device> at <mount> (<free> free, <needed> needed)``. The zip writer's text carries no
errno, so it counts as full only where the filesystem is nearly full, measured before anything
partial is removed.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import uuid

_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# What the errno-less wrappers keep of ENOSPC / EDQUOT: strerror's text, or the zip writer's own
# failure, which only a short write (a full disk, in practice) produces.
_FULL_TEXTS = ("no space left on device", "disk quota exceeded", "storagefull", "os error 28", "errno 28",
               "inline_container.cc")


class DiskFullError(RuntimeError):
    """A write failed because the disk is full; the message is the one line to show."""


def chained_errors(e: BaseException):
    """``e``, its causes and contexts, and the per-rank failures DCP wraps (each once)."""
    seen, todo = set(), [e]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        todo += [cur.__cause__, cur.__context__]
        failures = getattr(cur, "failures", None)  # CheckpointException: rank -> (exception, traceback)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def is_disk_full(e: BaseException, *, nearly_full_path: str | None = None) -> bool:
    """Whether ``e`` (or anything it wraps) is a full disk or quota. The zip writer's
    ``inline_container.cc`` failure counts as full only when ``nearly_full_path``'s filesystem
    has under 1 % free (it also reports other short writes)."""
    for cur in chained_errors(e):
        if isinstance(cur, OSError) and cur.errno in _FULL_ERRNOS:
            return True
        text = str(cur).lower()
        if any(t in text for t in _FULL_TEXTS[:-1]):
            return True
        if _FULL_TEXTS[-1] in text and nearly_full_path is not None:
            try:
                usage = shutil.disk_usage(existing_parent(nearly_full_path))
            except OSError:
                continue
            if usage.free < 0.01 * usage.total:
                return True
    return False


def error_path(e: BaseException) -> str | None:
    """The file an OSError inside ``e`` names, if any."""
    for cur in chained_errors(e):
        if isinstance(cur, OSError) and cur.filename:
            return os.fsdecode(cur.filename)
    return None


def existing_parent(path: str) -> str:
    """``path`` or its nearest existing ancestor (what ``disk_usage`` can measure)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def mount_of(path: str) -> tuple[str, str]:
    """(device, mount point) of the filesystem holding ``path``; device '?' when unknown."""
    mount = os.path.realpath(existing_parent(path))
    while not os.path.ismount(mount):
        mount = os.path.dirname(mount)
    device = "?"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:  # the last entry for a mount point is the one in effect
                parts = line.split()
                if len(parts) > 1 and parts[1].replace("\\040", " ") == mount:
                    device = parts[0]
    except OSError:
        pass
    return device, mount


def free_bytes(path: str) -> int | None:
    try:
        return shutil.disk_usage(existing_parent(path)).free
    except OSError:
        return None


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (a folder or one file); 0 when it is gone."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def disk_full_line(path: str, *, needed: int | str | None = None, free: int | None = None) -> str:
    """``disk full on <device> (<mount>) (<free> free, <needed> needed)`` for the filesystem of
    ``path``. ``free`` should be measured before anything partial is cleaned up (afterwards the
    disk looks emptier than it was when the write failed); ``needed`` is bytes, or a phrase."""
    device, mount = mount_of(path)
    where = device if device == mount else f"{device} at {mount}"
    free = free_bytes(path) if free is None else free
    have = "unknown space" if free is None else human_bytes(free)
    if needed is None:
        need = "more"
    elif isinstance(needed, int):
        need = human_bytes(needed)
    else:
        need = needed
    return f"disk full on {where} ({have} free, {need} needed)"


def write_atomic(path: str, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` through a temporary file and a rename: a
    full disk (or a kill) leaves the previous file whole, never truncated; the temporary file goes
    too. The temporary name is the writer's own, so processes writing the same path at once each
    rename a whole file (the last one wins) instead of truncating each other's."""
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as f:  # a name of its own; the umask's permissions, like the file it replaces
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:  # a failed or interrupted write leaves no temporary file behind
        if os.path.lexists(tmp):
            try:
                os.remove(tmp)
            except OSError:
                pass


def quiet_writer_thread_disk_full() -> None:
    """TensorBoard writes from a thread; on ENOSPC the thread dies with a traceback on stderr and
    the training thread re-raises the same error at its next write (said there in one line). Keep
    that thread's traceback off stderr; any other thread's exception is reported as before."""
    previous = threading.excepthook
    if getattr(previous, "_titan_draft", False):
        return

    def hook(args):
        if type(args.thread).__module__.startswith("tensorboard.") and args.exc_value is not None \
                and is_disk_full(args.exc_value):
            return
        previous(args)

    hook._titan_draft = True
    threading.excepthook = hook
