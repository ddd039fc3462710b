"""A failed save (disk full, no permission) says so in one line with the folder and the free space,
removes its partial folder, keeps the previous checkpoints, and stops the run."""

from __future__ import annotations

import errno
import os
from collections import namedtuple

import pytest

import titan_draft.checkpoint.errors as checkpoint_errors
from titan_draft.checkpoint.errors import CheckpointSaveError
from titan_draft.checkpoint.integrity import verify_checkpoint
from titan_draft.components.disk_full import human_bytes, mount_of
from titan_draft.config.job_config import Checkpoint
from test_components_checkpoint import _assert_same, _manager, _parts, _train

_real_fsync = os.fsync


def _fail_shard_fsync(monkeypatch, error):
    """The disk fills while DCP flushes a shard: its fsync raises ``error`` (the data was written)."""

    def fsync(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".distcp"):
            raise error
        return _real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _two_saves(tmp_path, monkeypatch, error, usage=None):
    parts = _parts()
    mgr = _manager(tmp_path, parts, Checkpoint(interval=2, keep_latest_k=1))
    _train(parts, 2)
    assert mgr.save(2)
    import copy
    good = copy.deepcopy(parts)
    _train(parts, 2, start=3)
    _fail_shard_fsync(monkeypatch, error)
    if usage is not None:
        monkeypatch.setattr(checkpoint_errors.shutil, "disk_usage", usage if callable(usage) else (lambda p: usage))
    with pytest.raises(CheckpointSaveError) as err:
        mgr.save(4)
    monkeypatch.undo()
    return str(err.value), good


def test_disk_full_is_one_line_and_loses_nothing(tmp_path, monkeypatch):
    line, good = _two_saves(tmp_path, monkeypatch, OSError(errno.ENOSPC, "No space left on device"))
    root = tmp_path / "checkpoint"
    assert line.startswith(f"checkpoint: saving {root / 'step-4'} failed: disk full on "), line
    step2 = sum(f.stat().st_size for f in (root / "step-2").rglob("*") if f.is_file())
    assert f" free, about {human_bytes(step2)} needed) (" in line, line
    assert "No space left on device" in line and "\n" not in line
    assert f"the last good checkpoint is {root / 'step-2'}; the run stops" in line
    assert sorted(os.listdir(root)) == ["step-2"]  # the partial step-4 is gone, step-2 kept
    assert verify_checkpoint(str(root / "step-2")) is None
    resumed = _parts(seed=1)
    assert _manager(tmp_path, resumed).load() == 2
    _assert_same(good, resumed)


def test_torch_zip_writer_error_on_a_full_disk_is_called_full(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    line, _ = _two_saves(tmp_path, monkeypatch, RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),
                         usage=Usage(100 * 2**30, 100 * 2**30 - 2**20, 2**20))
    assert "failed: disk full on " in line and "inline_container.cc" in line, line
    assert "(1.00 MiB free, about " in line
    assert sorted(os.listdir(tmp_path / "checkpoint")) == ["step-2"]


def test_no_permission_is_named(tmp_path, monkeypatch):
    line, _ = _two_saves(tmp_path, monkeypatch, PermissionError(errno.EACCES, "Permission denied"))
    assert "failed, no permission to write there (" in line, line


def test_free_space_is_measured_before_the_partial_folder_goes(tmp_path, monkeypatch):
    """The partial step-4 is what filled the disk: the line shows the free space with it there,
    not the emptier disk after it was removed; and it names the device and mount point."""
    Usage = namedtuple("Usage", "total used free")
    partial = tmp_path / "checkpoint" / "step-4"

    def usage(path):
        free = 3 * 2**20 if partial.exists() else 50 * 2**30
        return Usage(100 * 2**30, 100 * 2**30 - free, free)

    line, _ = _two_saves(tmp_path, monkeypatch, OSError(errno.ENOSPC, "No space left on device"), usage=usage)
    assert "(3.00 MiB free, about " in line and "50.00 GiB" not in line, line
    device, mount = mount_of(str(tmp_path))
    assert f"disk full on {device}" in line and mount in line, line
    assert not partial.exists()
