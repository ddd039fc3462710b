"""A save that fails says why in one line, leaves no partial folder, and stops the run.

Disk full surfaces from DCP in many shapes (an ``OSError`` from a write or an fsync, torch's zip
writer's ``RuntimeError: [enforce fail at inline_container.cc:...]``, all wrapped per rank in a
``CheckpointException``), and none of them says "disk full"; ``components/disk_full.py`` tells
them apart. The free space is measured before the partial folder is removed (afterwards the disk
looks emptier than it was when the write failed), and what a save needs is estimated from the
newest complete checkpoint beside it.
"""

from __future__ import annotations

import errno
import os
import shutil

from titan_draft.components.disk_full import (chained_errors, disk_full_line, free_bytes, human_bytes, is_disk_full,
                                               tree_bytes)


class CheckpointSaveError(RuntimeError):
    """Saving a checkpoint failed; the message is the one line to show, and the run stops."""


def _needed(step_path: str, folder: str) -> str:
    """What one save takes: the size of the newest complete checkpoint, else more than the
    partial folder holds."""
    steps = []
    try:
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith("step-") and name[5:].isdigit() and os.path.abspath(path) != os.path.abspath(step_path) \
                    and os.path.isfile(os.path.join(path, ".metadata")):
                steps.append((int(name[5:]), path))
    except OSError:
        pass
    if steps:
        return f"about {human_bytes(tree_bytes(max(steps)[1]))}"
    return f"over {human_bytes(tree_bytes(step_path))}"  # what it had written when the disk filled


def describe_save_failure(error: BaseException, brief: str, step_path: str, folder: str, kept: str) -> str:
    """The one line for a failed save of ``step_path``; ``brief`` is the error in short, ``kept``
    says which checkpoint remains. Call it before the partial folder is removed."""
    if is_disk_full(error, nearly_full_path=folder):
        full = disk_full_line(folder, needed=_needed(step_path, folder), free=free_bytes(folder))
        return (f"checkpoint: saving {step_path} failed: {full} ({brief}); the partial folder was removed, "
                f"{kept}; the run stops")
    codes = {o.errno for o in chained_errors(error) if isinstance(o, OSError)}
    if errno.EACCES in codes or errno.EPERM in codes or errno.EROFS in codes:
        cause = "no permission to write there"
    else:
        cause = "the write failed"
    free = free_bytes(folder)
    space = "free space unknown" if free is None else f"{human_bytes(free)} free on that filesystem"
    return (f"checkpoint: saving {step_path} failed, {cause} ({brief}); {space}; the partial folder "
            f"was removed, {kept}; the run stops")


def remove_partial(path: str) -> None:
    """Remove a step folder that a failed save left (nothing else is touched)."""
    shutil.rmtree(path, ignore_errors=True)
