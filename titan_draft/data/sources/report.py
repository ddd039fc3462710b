"""What reading one source file passed over, said once per file with line numbers.

A row that does not decode (bytes that are not UTF-8, a line that is not JSON) is kept as a
``BAD_JSON`` marker, so the pipeline counts it where it would have been trained on; this report
says at load time *where* those rows are: per file, per reason, the first line numbers (capped,
with how many more). A file of which no line decodes at all (a binary file named ``.jsonl``) is
called out as such.
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

    def log(self) -> None:
        if not self.rejected:
            return
        parts = []
        for reason, lines in self.lines.items():
            shown = ", ".join(map(str, lines[:LINES_SHOWN]))
            more = f" and {len(lines) - LINES_SHOWN} more" if len(lines) > LINES_SHOWN else ""
            parts.append(f"{len(lines)} {REASON_TEXT.get(reason, reason)} (line{'s' if len(lines) > 1 else ''} {shown}{more})")
        if self.good == 0:
            logger.warning("data.source: %s: none of its %d lines is a JSON row (%s): is it a JSON Lines file?",
                           self.path, self.rejected, "; ".join(parts))
        else:
            logger.warning("data.source: %s: %d of %d lines skipped: %s", self.path, self.rejected,
                           self.rejected + self.good, "; ".join(parts))
