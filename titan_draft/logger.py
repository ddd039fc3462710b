"""Logging setup: rank 0 logs at INFO, other ranks only warnings and errors."""

import logging
import os

logger = logging.getLogger("titan_draft")


def init_logger() -> None:
    """Configure the root logger once, so titan_draft.* and models.* loggers all print."""
    if getattr(init_logger, "_done", False):
        return
    init_logger._done = True
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        format="[titan_draft] %(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
        level=logging.INFO if rank == 0 else logging.WARNING,
    )
