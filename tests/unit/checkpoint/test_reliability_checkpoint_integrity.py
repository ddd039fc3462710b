"""Checkpoint integrity records: written last, verified on resume; a damaged checkpoint is passed
over for the newest one that verifies, and the log says which and why."""

from __future__ import annotations

import copy
import json
import logging
import os

import pytest

from titan_draft.checkpoint.integrity import RECORD, verify_checkpoint
from titan_draft.checkpoint.resume_guard import ResumeRefusedError
from titan_draft.config.job_config import Checkpoint
from test_components_checkpoint import _assert_same, _manager, _parts, _train


def _saved_run(tmp_path, steps=(2, 4, 6)):
    """Train to each of ``steps`` and save; returns the checkpoint root and a copy of the state at each."""
    parts = _parts()
    mgr = _manager(tmp_path, parts, Checkpoint(interval=2, keep_latest_k=0))
    snapshots, done = {}, 0
    for step in steps:
        _train(parts, step - done, start=done + 1)
        done = step
        assert mgr.save(step)
        snapshots[step] = copy.deepcopy(parts)
    return tmp_path / "checkpoint", snapshots


def _shard(folder):
    (name,) = [n for n in os.listdir(folder) if n.endswith(".distcp")]
    return folder / name


def test_the_record_lists_every_file_with_size_and_checksum(tmp_path):
    root, _ = _saved_run(tmp_path, steps=(2,))
    record = json.loads((root / "step-2" / RECORD).read_text())
    names = sorted(n for n in os.listdir(root / "step-2") if n != RECORD)
    assert sorted(record["files"]) == names and ".metadata" in names
    for name, entry in record["files"].items():
        assert entry["bytes"] == os.path.getsize(root / "step-2" / name)
        assert len(entry["sha256"]) == 64
    assert verify_checkpoint(str(root / "step-2")) is None


def test_resume_passes_over_damaged_checkpoints(tmp_path, caplog):
    root, snapshots = _saved_run(tmp_path)
    cut = _shard(root / "step-6")
    size = os.path.getsize(cut)
    with open(cut, "r+b") as f:  # a copy that stopped early
        f.truncate(size // 2)
    flipped = _shard(root / "step-4")
    data = bytearray(flipped.read_bytes())  # one byte altered in place: same size
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))

    resumed = _parts(seed=1)
    with caplog.at_level(logging.WARNING):
        assert _manager(tmp_path, resumed).load() == 2
    _assert_same(snapshots[2], resumed)
    line = next(r.getMessage() for r in caplog.records if "skipped" in r.getMessage())
    assert f"step-6 ({cut.name} is {size // 2} bytes, its {RECORD} says {size})" in line, line
    assert f"step-4 ({flipped.name} has other bytes than when it was saved" in line, line
    assert line.endswith("resuming from step-2")
    assert sorted(os.listdir(root)) == ["step-2", "step-4", "step-6"]  # nothing is deleted

    # an explicitly requested damaged step is refused, not replaced by another
    with pytest.raises(ResumeRefusedError, match=r"checkpoint step 4 requested but .*step-4 does not verify: .*; "
                                                 r"the other complete checkpoints in .* are step-2, step-6$"):
        _manager(tmp_path, _parts(), Checkpoint(load_step=4)).load()


def test_a_missing_or_unknown_file_fails_verification(tmp_path):
    root, _ = _saved_run(tmp_path, steps=(2,))
    (root / "step-2" / "stray.bin").write_bytes(b"x")
    assert verify_checkpoint(str(root / "step-2")) == f"stray.bin is not in its {RECORD}"
    os.remove(root / "step-2" / "stray.bin")
    os.remove(_shard(root / "step-2"))
    assert verify_checkpoint(str(root / "step-2")).endswith(".distcp is missing")


def test_no_checkpoint_verifies_is_an_error_not_a_fresh_start(tmp_path):
    root, _ = _saved_run(tmp_path, steps=(2,))
    with open(_shard(root / "step-2"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(ResumeRefusedError, match=r"none of the 1 checkpoint\(s\) in .* verifies \(step-2 \("):
        _manager(tmp_path, _parts()).load()


def test_a_checkpoint_without_record_loads_unverified(tmp_path, caplog):
    root, snapshots = _saved_run(tmp_path, steps=(2, 4))
    os.remove(root / "step-4" / RECORD)  # written before integrity records existed
    resumed = _parts(seed=1)
    with caplog.at_level(logging.WARNING):
        assert _manager(tmp_path, resumed).load() == 4
    _assert_same(snapshots[4], resumed)
    assert f"step-4 has no {RECORD}: resuming from it unverified" in caplog.text
