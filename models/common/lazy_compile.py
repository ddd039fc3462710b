"""``torch.compile`` of a helper, made on its first call rather than at import.

``torch.compile`` imports dynamo and inductor (1.5-3 s on a CPU). A module-level compiled helper
makes every process that imports the module pay that, also the many that never compile (a CPU
job, a data script, each rank of a torchrun launch). Inside a region that is already being
compiled the helper is called as is, so dynamo traces it into that region's graph, which is what
it does with a nested compiled function too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class LazyCompiled:
    """``torch.compile(fn, **options)`` on first use (module docstring)."""

    def __init__(self, fn: Callable, **options: Any):
        self.fn, self.options = fn, options
        self._compiled: Callable | None = None

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.fn(*args, **kwargs)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, **self.options)
        return self._compiled(*args, **kwargs)
