"""What reading one source file passed over, said once per file with line numbers.

A row that does not decode (bytes that are not UTF-8, a line that is not JSON) is kept as a
``BAD_JSON`` marker, so the pipeline counts it where it would have been trained on; this report
says at load time *where* those rows are: per file, per reason, the first line numbers (capped,
with how many more). A file of which no line decodes at all (a binary file named ``.jsonl``) gives
no rows: it is named, passed over whole and counted in its folder's report, wherever it sorts; only
a source with no usable file is refused.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

logger = logging.getLogger(__name__)

LINES_SHOWN = 10  # line numbers listed per reason and file; the rest are counted

REASON_TEXT = {"invalid_utf8": "not UTF-8", "bad_json": "not JSON"}


class FileReport:
    """Rejected lines of one file (1-based line numbers)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: dict[str, list[int]] = defaultdict(list)
        self.good = 0

    def reject(self, reason: str, line: int) -> None:
        self.lines[reason].append(line)

    @property
    def rejected(self) -> int:
        return sum(len(v) for v in self.lines.values())

    def describe(self) -> str:
        """The rejected lines, per reason with their first line numbers."""
        parts = []
        for reason, lines in self.lines.items():
            shown = ", ".join(map(str, lines[:LINES_SHOWN]))
            more = f" and {len(lines) - LINES_SHOWN} more" if len(lines) > LINES_SHOWN else ""
            parts.append(f"{len(lines)} {REASON_TEXT.get(reason, reason)} (line{'s' if len(lines) > 1 else ''} {shown}{more})")
        return "; ".join(parts)

    def unusable(self) -> str:
        """Why the whole file is passed over (none of its lines decodes)."""
        return f"none of its {self.rejected} lines is a JSON row ({self.describe()}): is it a JSON Lines file?"

    def log(self) -> None:
        if not self.rejected:
            return
        if self.good == 0:
            logger.warning("data.source: %s: %s", self.path, self.unusable())
        else:
            logger.warning("data.source: %s: %d of %d lines skipped: %s", self.path, self.rejected,
                           self.rejected + self.good, self.describe())


class FolderReport:
    """The files of a folder source that were passed over whole, and why; said once, with the
    count, when the read ends (or stops early at ``data.max_rows``)."""

    def __init__(self, folder: Path, num_files: int) -> None:
        self.folder, self.num_files = folder, num_files
        self.skipped: list[tuple[str, str]] = []  # (file name, why)
        self.rows = 0

    def skip(self, path: Path, why: str) -> None:
        self.skipped.append((path.name, why))
        logger.warning("data.source: %s: %s; the file is skipped", path, why)

    def log(self) -> None:
        if self.skipped:
            logger.warning("data.source: folder %s: %d of its %d .json/.jsonl files skipped as unreadable (%s); "
                           "the others are read", self.folder, len(self.skipped), self.num_files,
                           ", ".join(name for name, _ in self.skipped))

    def check_usable(self) -> None:
        """Refuse the folder only when no file gave a row and some were unreadable."""
        if self.rows == 0 and self.skipped:
            whys = "; ".join(f"{name}: {why}" for name, why in self.skipped)
            raise ValueError(f"data.source: no file of folder {self.folder} has a usable row ({whys})")
