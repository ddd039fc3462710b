"""The files of a folder source are judged one by one: an unreadable one (a binary file named
.jsonl, a .json that is not UTF-8) is named, skipped and counted wherever it sorts; only a source
with no usable file is refused, and the refusal names the files, not data.max_length."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from helpers import job_args

import titan_draft.train as train_module
from titan_draft.data.sources.rows import BAD_JSON, load_rows

BINARY = bytes(range(256)) * 4  # e.g. a parquet file renamed: NUL bytes, bytes that are not UTF-8, newlines


def _row(i):
    return json.dumps({"conversations": [{"from": "human", "value": f"q {i}"}, {"from": "gpt", "value": f"a {i}"}]})


def _folder(tmp_path, **files):
    folder = tmp_path / "data"
    folder.mkdir()
    for name, content in files.items():
        (folder / name.replace("__", ".")).write_bytes(content if isinstance(content, bytes) else content.encode())
    return folder


@pytest.mark.parametrize("bad_name", ["0_first__jsonl", "z_last__jsonl", "0_list__json"])
def test_an_unreadable_file_is_skipped_wherever_it_sorts(tmp_path, caplog, bad_name):
    good = "".join(_row(i) + "\n" for i in range(3))
    bad = BINARY if bad_name.endswith("jsonl") else b'[{"conversations": "\xff"}]'
    folder = _folder(tmp_path, m_good__jsonl=good, **{bad_name: bad})
    with caplog.at_level(logging.WARNING):
        rows, total = load_rows(str(folder))
    assert rows == [json.loads(_row(i)) for i in range(3)] and total == 3  # no BAD_JSON row from the bad file
    bad_path = folder / bad_name.replace("__", ".")
    msgs = [r.getMessage() for r in caplog.records]
    named = [m for m in msgs if m.startswith(f"data.source: {bad_path}: ")]
    assert len(named) == 1 and named[0].endswith("; the file is skipped"), msgs
    why = "none of its " if bad_name.endswith("jsonl") else "is not UTF-8 text (byte 20"
    assert why in named[0], named
    assert (f"data.source: folder {folder}: 1 of its 2 .json/.jsonl files skipped as unreadable "
            f"({bad_path.name}); the others are read") in msgs, msgs


def test_bad_lines_inside_a_good_file_are_still_counted_rows(tmp_path):
    folder = _folder(tmp_path, a__jsonl=b"\xff\xfe\n{bad\n" + _row(0).encode() + b"\n")
    rows, _ = load_rows(str(folder))
    assert rows[:2] == [BAD_JSON, BAD_JSON] and rows[2] == json.loads(_row(0))


def test_only_a_source_without_a_usable_file_is_refused(tmp_path):
    folder = _folder(tmp_path, a__jsonl=BINARY, b__json=b"\xff[]")
    with pytest.raises(ValueError) as err:
        load_rows(str(folder))
    line = str(err.value)
    assert line.startswith(f"data.source: no file of folder {folder} has a usable row (a.jsonl: none of its "), line
    assert "; b.json: is not UTF-8 text (byte 0" in line and "max_length" not in line, line
    single = folder / "a.jsonl"
    with pytest.raises(ValueError, match=rf"^data.source: {single}: none of its \d+ lines is a JSON row \("):
        load_rows(str(single))


def test_a_binary_file_sorting_first_does_not_refuse_the_job(capsys, monkeypatch, chat_jsonl, random_target_dir,
                                                             tmp_path):
    """The start-up check reads the first rows of the folder: they come from the good file."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "0.jsonl").write_bytes(BINARY * 64)  # more "lines" than the check reads
    shutil.copy(chat_jsonl, folder / "chat.jsonl")

    def reached(cfg):
        raise AssertionError("checks passed")

    monkeypatch.setattr(train_module, "Trainer", reached)
    with pytest.raises(AssertionError, match="checks passed"):
        train_module.main(job_args(tmp_path / "dump", str(folder), random_target_dir))
    assert "titan_draft: error" not in capsys.readouterr().err
