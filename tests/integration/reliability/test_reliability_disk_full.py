"""A full disk is called a full disk wherever it is met (the run lock, the export, TensorBoard or
the log), in one line ``disk full on <device> (<free> free, <needed> needed)``, exit 1, and
nothing saved before is lost. (The checkpoint save: tests/unit/checkpoint/test_reliability_failed_save.py.)"""

from __future__ import annotations

import builtins
import errno
import io
import os
import threading

import pytest
import torch
from helpers import job_args
from safetensors import SafetensorError
from torch import nn

import titan_draft.checkpoint.export as export_module
import titan_draft.train as train_module
from titan_draft.components.disk_full import DiskFullError, is_disk_full, mount_of
from titan_draft.components.run_lock import maybe_acquire_run_lock

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def _main_fails(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("titan_draft: error: "), err
    return err[-1][len("titan_draft: error: "):]


def test_disk_full_when_taking_the_run_lock(capsys, monkeypatch, chat_jsonl, random_target_dir, tmp_path):
    """The first write of a run (the lock file naming its holder) meets the full disk."""
    dump = tmp_path / "dump"

    def fsync(fd):
        raise ENOSPC

    monkeypatch.setattr(train_module, "Trainer", lambda cfg: maybe_acquire_run_lock(cfg.job.dump_folder, True))
    monkeypatch.setattr(os, "fsync", fsync)
    line = _main_fails(capsys, job_args(dump, chat_jsonl, random_target_dir))
    device, _ = mount_of(str(dump))
    assert line.startswith(f"writing {dump} failed: disk full on {device}"), line
    assert " free, more needed); the checkpoints already saved are kept" in line, line
    assert not (dump / ".titan_draft.lock").exists()  # no empty lock file left behind


def test_disk_full_in_tensorboard_is_one_line(capsys, monkeypatch, chat_jsonl, random_target_dir, tmp_path):
    """TensorBoard writes from its own thread: the thread dies of ENOSPC and the training thread
    meets the error at its next write. One line, no thread traceback."""
    from tensorboard.summary.writer import record_writer

    real, writes = record_writer.RecordWriter.write, []

    def write(self, data):
        writes.append(len(data))
        if len(writes) > 2:  # the file header and the first record fit, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    # Python's own hook, which prints a dying thread's traceback to stderr (pytest's turns it into a warning)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    dump = tmp_path / "dump"
    with pytest.raises(SystemExit) as exit_info:
        train_module.main(job_args(dump, chat_jsonl, random_target_dir, "--metrics.enable_tensorboard", "true",
                                   "--training.steps", "3"))
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"titan_draft: error: writing {dump} failed: disk full on "), last
    assert last.endswith(" free, more needed); the checkpoints already saved are kept"), last


class _FullDiskFile:
    """A file opened for writing on a full disk: opening truncates it, writing fails."""

    def __init__(self, real):
        self._real = real

    def write(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._real.close()


def test_a_full_disk_at_resume_truncates_none_of_the_run_files(capsys, monkeypatch, chat_jsonl, random_target_dir,
                                                                tmp_path):
    """job_config.toml, run_info.json and model_args.json are rewritten at every start; on a full
    disk the first run's copies (what the eval of a DCP checkpoint reads) must stay whole."""
    dump = tmp_path / "dump"
    train_module.main(job_args(dump, chat_jsonl, random_target_dir, "--training.steps", "1",
                               "--checkpoint.export", "false"))
    names = ("job_config.toml", "run_info.json", "model_args.json")
    before = {n: (dump / n).read_bytes() for n in names}
    assert all(before.values())
    real_open = io.open

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if "w" in mode and str(file).startswith(str(dump)) and not str(file).endswith(".titan_draft.lock"):
            return _FullDiskFile(f)
        return f

    monkeypatch.setattr(builtins, "open", full_open)
    monkeypatch.setattr(io, "open", full_open)
    # resumes from step 1 (a longer schedule is a change the resume guard must be told to apply)
    line = _main_fails(capsys, job_args(dump, chat_jsonl, random_target_dir, "--training.steps", "2",
                                        "--checkpoint.export", "false",
                                        "--checkpoint.apply_new_optimizer_settings", "true"))
    monkeypatch.undo()
    assert "failed: disk full on " in line, line
    assert {n: (dump / n).read_bytes() for n in names} == before
    assert not [p for p in dump.iterdir() if p.name.endswith(".tmp")]


def test_wrapped_disk_full_errors_are_recognized(tmp_path):
    assert is_disk_full(RuntimeError("save failed")) is False
    assert is_disk_full(SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                        'message: "No space left on device" })'))
    try:
        try:
            raise ENOSPC
        except OSError as e:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from e
    except RuntimeError as e:
        assert is_disk_full(e)
    # the zip writer's own failure without an errno: full only where the disk is (nearly) full
    zip_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    assert not is_disk_full(zip_error, nearly_full_path=str(tmp_path)) or \
        os.statvfs(tmp_path).f_bavail < 0.01 * os.statvfs(tmp_path).f_blocks


class _Tiny(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(8, 8, bias=False)


def _export(out, seed):
    return export_module.export_draft(_Tiny(seed), lambda sd, a, t: (dict(sd), {"seed": seed}), None, {}, str(out),
                                      dtype="float32")


def _files(folder):
    return {name: (folder / name).read_bytes() for name in sorted(os.listdir(folder))}


@pytest.mark.parametrize("where", ["weights", "config"])
def test_disk_full_during_export_keeps_the_previous_export(tmp_path, monkeypatch, where):
    out = tmp_path / "export"
    _export(out, seed=0)
    before = _files(out)
    if where == "weights":  # what safetensors raises: the errno only in its text
        def save_file(*a, **k):
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                  'message: "No space left on device" })')
        monkeypatch.setattr(export_module, "save_file", save_file)
    else:  # the weights fit, the config does not
        def write_json(path, obj):
            raise OSError(errno.ENOSPC, "No space left on device", path + ".tmp")
        monkeypatch.setattr(export_module, "_write_json_tmp", write_json)
    with pytest.raises(DiskFullError) as err:
        _export(out, seed=1)
    line = str(err.value)
    assert line.startswith(f"export: writing {out} failed: disk full on "), line
    assert " free, 256 B needed); what was saved before (checkpoints, an earlier export) is kept" in line, line
    assert _files(out) == before  # the previous export whole, no new file beside it, no .tmp left
