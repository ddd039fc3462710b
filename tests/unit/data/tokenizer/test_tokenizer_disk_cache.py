"""The on-disk cache of checked tokenizer.json files (titan_draft/data/tokenizer/disk_cache.py): a
hit gives what the full check gives without running it; an edited file, a changed check, or a
broken entry is checked in full; a file that fails its check is never stored."""

from __future__ import annotations

import json
import os

import pytest

from titan_draft.components import disk_full
from titan_draft.data.tokenizer import disk_cache, hf_files
from titan_draft.data.tokenizer.hf_files import load_tokenizer_files
from test_data_tokenizer_hf import tiny_json, write_json


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(root))
    calls = []
    real = hf_files._read_tokenizer_json

    def counted(path):
        calls.append(path)
        return real(path)

    monkeypatch.setattr(hf_files, "_read_tokenizer_json", counted)
    return root, calls


def _entries(root):
    folder = root / "tokenizers"
    return sorted(os.listdir(folder)) if folder.exists() else []


def test_a_hit_equals_the_full_check_without_running_it(cache, tmp_path):
    root, calls = cache
    path = write_json(tmp_path / "a", tiny_json())
    first = load_tokenizer_files(path)
    assert len(calls) == 1 and len(_entries(root)) == 1
    again = load_tokenizer_files(path)
    assert len(calls) == 1  # read from the entry
    assert again == first
    # the same bytes elsewhere: the entry serves, under the new file's own name
    other = write_json(tmp_path / "b", tiny_json())
    moved = load_tokenizer_files(other)
    assert len(calls) == 1 and moved.source == other and moved.ranks == first.ranks


def test_an_edited_file_is_checked_in_full_and_a_bad_one_never_stored(cache, tmp_path):
    root, calls = cache
    good = tiny_json()
    path = write_json(tmp_path, good)
    load_tokenizer_files(path)
    bad = json.loads(json.dumps(good))
    bad["model"]["merges"] = ["ab c", "a b", "Ġ t"]  # out of id order: refused by the check
    write_json(tmp_path, bad)
    with pytest.raises(ValueError, match="merges are not in id order"):
        load_tokenizer_files(path)
    with pytest.raises(ValueError, match="merges are not in id order"):
        load_tokenizer_files(path)
    assert len(calls) == 3 and len(_entries(root)) == 1  # only the good file's entry


def test_a_changed_check_is_a_miss(cache, tmp_path, monkeypatch):
    root, calls = cache
    path = write_json(tmp_path, tiny_json())
    load_tokenizer_files(path)
    monkeypatch.setattr(disk_cache, "code_key", lambda: b"another version of the checks")
    load_tokenizer_files(path)
    assert len(calls) == 2 and len(_entries(root)) == 2


def test_a_broken_entry_is_checked_again_and_written_over(cache, tmp_path, caplog):
    root, calls = cache
    path = write_json(tmp_path, tiny_json())
    first = load_tokenizer_files(path)
    (entry,) = _entries(root)
    (root / "tokenizers" / entry).write_bytes(b"\x80cut off")
    assert load_tokenizer_files(path) == first and len(calls) == 2
    assert "is unreadable" in caplog.text
    assert load_tokenizer_files(path) == first and len(calls) == 2  # whole again


def test_off_and_an_unwritable_folder(tmp_path, monkeypatch, caplog):
    path = write_json(tmp_path, tiny_json())
    monkeypatch.setenv(disk_cache.CACHE_ENV, "off")
    assert disk_cache.cache_root() is None
    expected = load_tokenizer_files(path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(disk_cache.CACHE_ENV, str(blocker / "below"))  # a folder under a file
    disk_cache._warn_once.cache_clear()
    assert load_tokenizer_files(path) == expected
    assert "tokenizer cache: cannot write under" in caplog.text
    assert not (tmp_path / "file.tmp").exists() and sorted(os.listdir(tmp_path)) == ["file", "tokenizer.json"]


def test_an_interrupted_write_leaves_no_temporary_file(cache, tmp_path, monkeypatch):
    root, calls = cache
    path = write_json(tmp_path, tiny_json())

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(disk_full.os, "fsync", interrupted)  # the temporary file is open, half written
    with pytest.raises(KeyboardInterrupt):
        load_tokenizer_files(path)
    assert _entries(root) == []  # neither an entry nor a .tmp
