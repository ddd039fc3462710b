"""write_atomic: the previous file stays whole until a whole new one replaces it, for any writer."""

from __future__ import annotations

import os

import pytest

from titan_draft.components import disk_full
from titan_draft.components.disk_full import write_atomic


def test_text_and_bytes_replace_the_file_whole(tmp_path):
    path = str(tmp_path / "f")
    write_atomic(path, "première\n")
    assert open(path, "rb").read() == "première\n".encode("utf-8")
    write_atomic(path, b"\x00\x80 bytes")
    assert open(path, "rb").read() == b"\x00\x80 bytes" and os.listdir(tmp_path) == ["f"]


def test_a_failed_write_keeps_the_previous_file_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = str(tmp_path / "f")
    write_atomic(path, "old")

    def interrupted(fd):
        raise KeyboardInterrupt  # a kill or ^C with the temporary file half written

    monkeypatch.setattr(disk_full.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, "new")
    assert open(path).read() == "old" and os.listdir(tmp_path) == ["f"]


def test_two_writers_of_one_path_each_rename_a_whole_file(tmp_path, monkeypatch):
    """A second writer of the same path (another rank, another eval) starts while the first is
    between writing and renaming: each renames its own temporary file, the last one wins, whole."""
    path = str(tmp_path / "f")
    fsync = os.fsync
    inner = []

    def second_writer_meanwhile(fd):
        fsync(fd)
        if not inner:
            inner.append(1)
            write_atomic(path, "second " * 1000)
            assert open(path).read() == "second " * 1000

    monkeypatch.setattr(disk_full.os, "fsync", second_writer_meanwhile)
    write_atomic(path, "first")
    assert open(path).read() == "first" and os.listdir(tmp_path) == ["f"]
