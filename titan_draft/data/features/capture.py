"""Captured target features from the device to the host, overlapped with the next forward.

prepare_features runs the target batch after batch. Copying a batch's features to the host with
a plain ``.cpu()`` stops the host until the forward and the copy are done, so the GPU waits while
the host slices rows and hands them to the shard writer. Here, on CUDA, batch i's features are
copied on a side stream into one of two pinned host buffers while the target already computes
batch i+1, and batch i is handed out (to be sliced and written) only once its copy has finished.

The forward is timed with CUDA events on the compute stream: the figure is what the target costs
on the device, not how long the host waited for it. On CPU the features are already on the host;
batches are handed out one push later all the same, so the caller's loop is the same everywhere.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

__all__ = ["CapturedBatch", "FeatureCopier"]


@dataclass
class CapturedBatch:
    """One batch's rows and its named feature tensors on the host (valid until the second ``push``
    after the one that returned it: the pinned buffer is then reused, so copy out what is kept)."""

    rows: Any
    tensors: dict[str, torch.Tensor]


class _Slot:
    """Pinned host memory for one batch's features and the event that says its copy has finished.

    The memory is kept flat and only grows (by doubling), and each batch gets a view of its
    shape: with dynamic shapes every batch differs, and pinning memory anew each time would cost
    more than the copy."""

    def __init__(self, pin: bool = True) -> None:
        self.pin = pin
        self._flat: dict[str, torch.Tensor] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.done: Optional[torch.cuda.Event] = None

    def view(self, name: str, like: torch.Tensor) -> torch.Tensor:
        flat = self._flat.get(name)
        if flat is None or flat.dtype != like.dtype or flat.numel() < like.numel():
            size = max(like.numel(), 2 * flat.numel() if flat is not None and flat.dtype == like.dtype else 0)
            flat = self._flat[name] = torch.empty(size, dtype=like.dtype, pin_memory=self.pin)
        return flat[: like.numel()].view(like.shape)


class FeatureCopier:
    """``push(rows, tensors)`` after each forward returns the previous batch (or None); ``flush()``
    after the last forward returns the last one; ``forward()`` times a forward."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._pending: Optional[tuple[Any, _Slot | CapturedBatch]] = None
        self._slots = [_Slot(), _Slot()] if self.cuda else []
        self._next_slot = 0
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._host_times: list[float] = []

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Time the forward run inside (CUDA events, read once at the end; wall clock on CPU)."""
        if not self.cuda:
            t0 = time.perf_counter()
            yield
            self._host_times.append(time.perf_counter() - t0)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self._events.append((start, end))

    def forward_times(self) -> list[float]:
        """Seconds of each timed forward, in order (synchronizes on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [s.elapsed_time(e) / 1e3 for s, e in self._events]
        return list(self._host_times)

    def push(self, rows: Any, tensors: dict[str, torch.Tensor]) -> Optional[CapturedBatch]:
        """Start moving this batch's tensors to the host; the previous batch, copied, or None."""
        if self.cuda:
            slot = self._slots[self._next_slot]
            self._next_slot = 1 - self._next_slot
            slot.tensors = {name: slot.view(name, t) for name, t in tensors.items()}
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # the forward wrote them
            with torch.cuda.stream(self._stream):
                for name, t in tensors.items():
                    slot.tensors[name].copy_(t, non_blocking=True)
                slot.done = torch.cuda.Event()
                slot.done.record()
            # the allocator must not hand the device tensors out again before the copy has read them
            for t in tensors.values():
                t.record_stream(self._stream)
            entry: Any = slot
        else:
            entry = CapturedBatch(rows, dict(tensors))
        previous, self._pending = self._pending, (rows, entry)
        return None if previous is None else self._finish(previous)

    def flush(self) -> Optional[CapturedBatch]:
        """The last pushed batch, copied (None when there is none)."""
        previous, self._pending = self._pending, None
        return None if previous is None else self._finish(previous)

    @staticmethod
    def _finish(pending: tuple[Any, Any]) -> CapturedBatch:
        rows, entry = pending
        if isinstance(entry, CapturedBatch):
            return entry
        entry.done.synchronize()
        return CapturedBatch(rows, entry.tensors)
