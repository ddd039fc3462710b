"""A save that fails says why in one line, leaves no partial folder, and stops the run.

Disk full surfaces from DCP in many shapes (an ``OSError`` from a write or an fsync, torch's zip
writer's ``RuntimeError: [enforce fail at inline_container.cc:...]``, all wrapped per rank in a
``CheckpointException``), and none of them says "disk full". So the line reports the free space
of the checkpoint filesystem beside the error, and calls it full when the error is ENOSPC or
almost nothing is left.
"""

from __future__ import annotations

import errno
import os
import shutil

from torch.distributed.checkpoint.api import CheckpointException

_NEARLY_FULL = 0.01  # free fraction under which the filesystem is called full


class CheckpointSaveError(RuntimeError):
    """Saving a checkpoint failed; the message is the one line to show, and the run stops."""


def _os_errors(e: BaseException):
    """OSErrors inside ``e``: its causes, contexts and DCP's per-rank failures."""
    seen, todo = set(), [e]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, OSError):
            yield cur
        todo += [cur.__cause__, cur.__context__]
        if isinstance(cur, CheckpointException):  # rank -> (exception, traceback)
            todo += [f[0] if isinstance(f, tuple) else f for f in cur.failures.values()]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def describe_save_failure(error: BaseException, brief: str, step_path: str, folder: str, kept: str) -> str:
    """The one line for a failed save of ``step_path``; ``brief`` is the error in short, ``kept``
    says which checkpoint remains."""
    try:
        usage = shutil.disk_usage(folder if os.path.isdir(folder) else os.path.dirname(folder) or ".")
        space = f"{_gib(usage.free)} free of {_gib(usage.total)} on that filesystem"
        nearly_full = usage.free < _NEARLY_FULL * usage.total
    except OSError as e:
        space, nearly_full = f"free space unknown ({e.strerror})", False
    codes = {o.errno for o in _os_errors(error)}
    if errno.ENOSPC in codes or errno.EDQUOT in codes or nearly_full:
        cause = "the disk is full"
    elif errno.EACCES in codes or errno.EPERM in codes or errno.EROFS in codes:
        cause = "no permission to write there"
    else:
        cause = "the write failed"
    return (f"checkpoint: saving {step_path} failed, {cause} ({brief}); {space}; the partial folder "
            f"was removed, {kept}; the run stops")


def remove_partial(path: str) -> None:
    """Remove a step folder that a failed save left (nothing else is touched)."""
    shutil.rmtree(path, ignore_errors=True)
