"""Spawning gloo ranks from a test: a free port per attempt, and native aborts made visible.

CI once lost a whole 2-rank module to ``terminate called without an active exception`` (SIGABRT in
rank 0, a C++ abort with no Python traceback) that 130+ local repetitions of the same workers did
not reproduce. So every rank runs with ``faulthandler`` writing all threads' Python stacks to a
file, and a rank killed by a signal is retried once with a fresh port: the test passes only if a
whole retry passes, and the pytest warning it leaves carries the stacks of the abort. A Python
exception in a rank or a non-zero exit is never retried.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import tempfile
import traceback
import warnings
from typing import Callable

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessExitedException


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, port: int, stacks_dir: str, args: tuple) -> None:
    # left open on purpose: an abort during interpreter shutdown must still be written
    faulthandler.enable(file=open(os.path.join(stacks_dir, f"rank{rank}.txt"), "w"), all_threads=True)
    fn(rank, port, *args)


def _stacks(stacks_dir: str, rank: int) -> str:
    path = os.path.join(stacks_dir, f"rank{rank}.txt")
    if not os.path.exists(path):
        return "(no stacks file)"
    with open(path) as f:
        return f.read().strip() or "(faulthandler wrote nothing)"


def spawn_ranks(fn: Callable, *args, nprocs: int = 2, attempts: int = 2) -> None:
    """Run ``fn(rank, port, *args)`` in ``nprocs`` spawned processes (``port``: free, for the
    rank-0 store). Retries only a run in which a rank died from a signal; ``fn`` must therefore
    write its outputs fresh on every run."""
    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory(prefix="rank-stacks-") as stacks_dir:
            try:
                mp.spawn(_entry, args=(fn, free_port(), stacks_dir, args), nprocs=nprocs, join=True)
                return
            except ProcessExitedException as e:
                died = e.signal_name or f"exit code {e.exit_code}"
                what = (f"rank {e.error_index} of {fn.__name__} died with {died} (attempt {attempt} of "
                        f"{attempts}); its threads at the abort:\n{_stacks(stacks_dir, e.error_index)}")
                if e.signal_name is None or attempt == attempts:
                    raise RuntimeError(what) from e
                warnings.warn(what + "\nretrying with a fresh port", stacklevel=2)


def write_rank_result(out_dir: str, rank: int, compute: Callable[[], dict]) -> None:
    """Run ``compute()`` in a rank and write its JSON result, or the traceback of the Python
    error it raised, to ``rank{rank}.json`` (the test reads every rank's file)."""
    try:
        result = compute()
    except Exception:
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
