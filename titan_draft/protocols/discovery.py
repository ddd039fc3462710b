"""Finding registered drafts and target families without naming them: every package under
``models`` (drafts) and ``models.targets`` (target families) registers its specs when imported, so
a lookup that misses imports them all once."""

from __future__ import annotations

import importlib
import pkgutil

_done = False


def import_model_packages() -> None:
    """Import every package under ``models`` and ``models.targets`` (once per process)."""
    global _done
    if _done:
        return
    _done = True
    for parent in ("models", "models.targets"):  # named as strings: the engine imports no model package
        package = importlib.import_module(parent)
        for info in pkgutil.iter_modules(package.__path__):
            if info.ispkg:
                importlib.import_module(f"{parent}.{info.name}")
