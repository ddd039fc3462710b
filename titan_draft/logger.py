"""Process-wide logger: rank 0 logs at INFO, other ranks only warnings and errors."""

import logging
import os

logger = logging.getLogger("titan_draft")


def init_logger() -> None:
    if getattr(init_logger, "_done", False):
        return
    init_logger._done = True
    rank = int(os.environ.get("RANK", "0"))
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[titan_draft] %(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    logger.propagate = False
