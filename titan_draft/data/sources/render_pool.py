"""A counting pass's rendering in forked processes (``epoch_samples(..., render_workers=N)``).

A draft's data pass (EAGLE-3 counts its vocabulary over every row before step 1) renders and
tokenizes the whole source in Python: 28886 SmolLM2 rows take ~8 s of one core, which threads do
not shorten (the rendering holds the GIL). Forked workers render chunks of rows and hand them back
in source order, so the pass yields exactly what one process would. Fork, not spawn: the workers
start at once with the source, tokenizer and chat format already built; they run only Python and
the tokenizer, never CUDA or a collective, and leave by ``os._exit`` without the parent's exit
handlers.
"""

from __future__ import annotations

import collections
import itertools
import multiprocessing as mp
import os
from typing import Any, Iterator

_NODE: Any = None  # the source node the forked workers render (set only while a pool is open)


def _render(bounds: tuple[int, int]) -> list:
    start, stop = bounds
    return [_NODE._sample(row) for row in _NODE.rows[start:stop]]


def default_render_workers() -> int:
    """Up to 8 processes, this host's cores shared among its ranks."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)))


def rendered_in_order(node: Any, workers: int, chunk_rows: int = 512) -> Iterator:
    """``node._sample(row)`` for every row of ``node.rows`` in order (a sample or a skip reason);
    by ``workers`` forked processes where there are at least two chunks of rows per worker. At
    most ``2 * workers`` chunks are rendered ahead of the reader: a slow reader (prepare_features'
    target forward) holds a few chunks in memory, not the whole source."""
    global _NODE
    n = len(node.rows)
    if workers <= 1 or n < 2 * workers * chunk_rows or "fork" not in mp.get_all_start_methods():
        yield from map(node._sample, node.rows)
        return
    chunks = iter([(i, min(i + chunk_rows, n)) for i in range(0, n, chunk_rows)])
    _NODE = node
    try:
        with mp.get_context("fork").Pool(workers) as pool:
            ahead = collections.deque(pool.apply_async(_render, (c,)) for c in itertools.islice(chunks, 2 * workers))
            while ahead:
                part = ahead.popleft().get()
                ahead.extend(pool.apply_async(_render, (c,)) for c in itertools.islice(chunks, 1))
                yield from part
    finally:
        _NODE = None
