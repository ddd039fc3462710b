"""Finding registered drafts and target families without naming them: every package under
``models`` registers its specs when imported, so a lookup that misses imports them all once."""

from __future__ import annotations

import importlib
import pkgutil

_done = False


def import_model_packages() -> None:
    """Import every package under ``models`` (once per process)."""
    global _done
    if _done:
        return
    _done = True
    import models

    for info in pkgutil.iter_modules(models.__path__):
        if info.ispkg:
            importlib.import_module(f"models.{info.name}")
