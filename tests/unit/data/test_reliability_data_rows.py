"""Data rows that do not decode are counted per file and reason with line numbers; unreadable and
ignored files are named; skip counts are per epoch; a tiny epoch is warned about."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from titan_draft.config.job_config import Data
from titan_draft.data.pipeline import build_dataloader
from titan_draft.data.sources.rows import BAD_JSON, load_rows


def _row(i):
    return json.dumps({"conversations": [{"from": "human", "value": f"q {i}"}, {"from": "gpt", "value": f"a {i}"}]})


def _messages(caplog):
    return [r.getMessage() for r in caplog.records]


def test_undecodable_lines_are_named_with_line_numbers(tmp_path, caplog):
    lines = [_row(0).encode(), b'{"conversations": "caf\xe9"}', _row(2).encode(), b"\xff\xfe\x00binary",
             b"{not json", _row(5).encode()] + [b"{cut"] * 12
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    with caplog.at_level(logging.WARNING):
        rows, total = load_rows(str(path))
    assert total == 18 and sum(r is BAD_JSON for r in rows) == 15
    (line,) = [m for m in _messages(caplog) if str(path) in m]
    assert line == (f"data.source: {path}: 15 of 18 lines skipped: 2 not UTF-8 (lines 2, 4); "
                    f"13 not JSON (lines 5, 7, 8, 9, 10, 11, 12, 13, 14, 15 and 3 more)"), line


def test_a_binary_file_is_called_out_and_the_good_files_still_train(tmp_path, tok, caplog):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(_row(i) + "\n" for i in range(4)))
    (folder / "b.jsonl").write_bytes(bytes(range(256)) * 4)  # e.g. a parquet file renamed
    (folder / "notes.txt").write_text("x")
    (folder / "c.parquet").write_bytes(b"PAR1")
    with caplog.at_level(logging.INFO):
        dl = build_dataloader(Data(source=str(folder), max_length=64, chat_template="chatml", prefetch_factor=0),
                              tok, dp_rank=0, dp_world=1, local_batch_size=2, seed=0, static_shapes=False)
        next(dl)
    msgs = _messages(caplog)
    assert any(m.startswith(f"data.source: {folder / 'b.jsonl'}: none of its ") and "not UTF-8" in m
               and "is it a JSON Lines file?" in m for m in msgs), msgs
    ignored = [m for m in msgs if "not .json/.jsonl are not read" in m]
    assert ignored == [f"data.source: files of {folder} that are not .json/.jsonl are not read: ['c.parquet', 'notes.txt']"]


def test_a_json_list_that_is_not_utf8_and_an_unreadable_file_are_one_line_errors(tmp_path, monkeypatch):
    bad = tmp_path / "rows.json"
    bad.write_bytes(b'[{"conversations": "\xff"}]')
    with pytest.raises(ValueError, match=rf"^data.source: {bad} is not UTF-8 text \(byte 20: invalid start byte\)"):
        load_rows(str(bad))
    locked = tmp_path / "locked.jsonl"
    locked.write_text(_row(0) + "\n")
    real_open = Path.open

    def deny(self, *args, **kwargs):
        if self == locked:
            raise PermissionError(13, "Permission denied")
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", deny)
    with pytest.raises(ValueError, match=rf"^data.source: cannot read {locked}: Permission denied$"):
        load_rows(str(locked))


def test_skip_counts_per_epoch_and_the_small_epoch_warning(tmp_path, tok, caplog):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([_row(0), "{bad", _row(2), _row(3)]) + "\n")
    with caplog.at_level(logging.INFO):
        dl = build_dataloader(Data(source=str(path), max_length=64, chat_template="chatml", shuffle=False,
                                   prefetch_factor=0), tok, dp_rank=0, dp_world=1, local_batch_size=1, seed=0,
                              static_shapes=False, warn_below_rows=10)
        for _ in range(7):  # epochs 0 and 1 (3 usable rows each), then the first row of epoch 2
            next(dl)
    assert dl.epoch == 2 and dl.epoch_skip_counts["bad_json"] == 0 and dl.skip_counts["bad_json"] == 2
    msgs = _messages(caplog)
    assert "data: epoch 0 done: 3 of 4 rows usable, skipped {'bad_json': 1}" in msgs
    assert "data: epoch 1 done: 3 of 4 rows usable, skipped {'bad_json': 1}" in msgs
    assert any(m.startswith("data: only 4 rows on DP rank 0 (at most that many usable), fewer than 10") for m in msgs)
    assert any(m.startswith("data: epoch 0 had only 3 usable rows on this DP rank, fewer than 10 optimizer") for m in msgs)
    next(dl)  # past the bad row of epoch 2
    assert dl.epoch_skip_counts["bad_json"] == 1 and dl.skip_counts["bad_json"] == 3
