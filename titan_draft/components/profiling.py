"""Optional torch.profiler traces and CUDA memory snapshots, every ``profile_freq`` steps.

Both are context managers around the training loop that yield an object with ``step()`` (call it
once per optimizer step) or None when disabled. Both take ``global_step`` so that a resumed run
keeps tracing at the same iterations (``iteration_N`` is the step that was recorded last).

Outputs:
- ``{dump_folder}/{save_traces_folder}/iteration_{N}/rank{R}_trace.json``: Chrome trace format;
  open it in Perfetto (ui.perfetto.dev), chrome://tracing, or TensorBoard's profile plugin.
- ``{dump_folder}/{save_memory_snapshot_folder}/iteration_{N}/rank{R}_memory_snapshot.pickle``
  (``iteration_{N}_exit`` when an OOM ends the run): open it at pytorch.org/memory_viz.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Iterator

import torch

from titan_draft.config.job_config import Profiling as ProfilingConfig

logger = logging.getLogger(__name__)

# Entries kept by the CUDA caching allocator's history ring buffer (torchtitan's default).
MEMORY_SNAPSHOT_MAX_ENTRIES = 100_000


@contextlib.contextmanager
def maybe_enable_profiling(
    cfg: ProfilingConfig, dump_folder: str, global_step: int = 0, rank: int = 0
) -> Iterator[torch.profiler.profile | None]:
    """Yield a running ``torch.profiler.profile`` (or None when ``enable_profiling`` is off).

    Schedule per ``profile_freq`` steps: wait ``freq - warmup - active``, warm up ``warmup``,
    record ``active``; the trace is written when the recorded window ends.
    """
    if not cfg.enable_profiling:
        yield None
        return
    freq, warmup, active = cfg.profile_freq, cfg.profile_warmup, cfg.profile_active
    wait = freq - warmup - active
    if warmup < 0 or active < 1 or wait < 0:
        raise ValueError(
            f"profiling.profile_freq ({freq}) must be >= profile_warmup ({warmup}) + "
            f"profile_active ({active}), with profile_active >= 1"
        )
    trace_root = os.path.join(dump_folder, cfg.save_traces_folder)

    def trace_handler(prof: torch.profiler.profile) -> None:
        folder = os.path.join(trace_root, f"iteration_{prof.step_num}")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank{rank}_trace.json")
        t0 = time.perf_counter()
        prof.export_chrome_trace(path)
        logger.info("profiling: wrote %s in %.2f s", path, time.perf_counter() - t0)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    logger.info(
        "profiling: tracing %d step(s) every %d steps into %s", active, freq, trace_root
    )
    with torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active),
        on_trace_ready=trace_handler,
        record_shapes=True,
    ) as prof:
        # The schedule is a function of step_num: starting from global_step makes a resumed run
        # trace the same iterations as an uninterrupted one.
        prof.step_num = global_step
        yield prof


class MemorySnapshotter:
    """Records the CUDA allocator history and dumps a snapshot every ``freq`` steps."""

    def __init__(self, folder: str, rank: int, global_step: int, freq: int) -> None:
        self.folder = folder
        self.rank = rank
        self.step_num = global_step
        self.freq = freq
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_SNAPSHOT_MAX_ENTRIES)

    def step(self, exit_ctx: bool = False) -> None:
        """Call after each optimizer step; ``exit_ctx`` dumps now (used on OOM)."""
        if not exit_ctx:
            self.step_num += 1
            if self.step_num % self.freq != 0:
                return
        name = f"iteration_{self.step_num}" + ("_exit" if exit_ctx else "")
        out = os.path.join(self.folder, name)
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, f"rank{self.rank}_memory_snapshot.pickle")
        t0 = time.perf_counter()
        torch.cuda.memory._dump_snapshot(path)
        logger.info("memory snapshot: wrote %s in %.2f s", path, time.perf_counter() - t0)

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


@contextlib.contextmanager
def maybe_enable_memory_snapshot(
    cfg: ProfilingConfig,
    dump_folder: str,
    global_step: int = 0,
    rank: int = 0,
    device_type: str | None = None,
) -> Iterator[MemorySnapshotter | None]:
    """Yield a ``MemorySnapshotter`` (or None when ``enable_memory_snapshot`` is off or the
    device is not CUDA: the snapshot is a CUDA caching-allocator feature).

    An out-of-memory error inside the context dumps a final ``iteration_{N}_exit`` snapshot
    before it propagates.
    """
    if not cfg.enable_memory_snapshot:
        yield None
        return
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type != "cuda":
        logger.info(
            "memory snapshot: enabled but the device is %s; CUDA only, nothing will be recorded",
            device_type,
        )
        yield None
        return
    if cfg.profile_freq < 1:
        raise ValueError(f"profiling.profile_freq must be >= 1, got {cfg.profile_freq}")
    folder = os.path.join(dump_folder, cfg.save_memory_snapshot_folder)
    snapshotter = MemorySnapshotter(folder, rank, global_step, cfg.profile_freq)
    logger.info(
        "memory snapshot: recording CUDA allocator history, dumping every %d steps into %s",
        cfg.profile_freq,
        folder,
    )
    try:
        yield snapshotter
    except torch.OutOfMemoryError:
        snapshotter.step(exit_ctx=True)
        raise
    finally:
        snapshotter.stop()
