"""Graceful stop on SIGTERM / SIGINT: finish the step, save it, exit 0 with a line saying where to resume.

SIGTERM is what Slurm and Kubernetes send some seconds before SIGKILL; SIGINT is Ctrl-C. The
first one only sets a flag; the training loop looks at it once per step, after the step's
checkpoint (if any), so the step in flight finishes, a checkpoint of it is written and the run
ends without exporting (a half-trained draft is not the job's result). A second signal means "now":
the process exits at once with 128 + the signal number, as an unhandled signal would; the
interrupted save, if any, is skipped by the next resume.

A signal repeated within ``REPEAT_WINDOW_S`` of the first is the same request delivered twice, not
a second one: Slurm signals every process of the step and torchrun forwards the signal it got to
its workers, and Ctrl-C reaches both torchrun and its workers, so one stop request often arrives
twice within milliseconds. (torchrun gives its workers 30 s after forwarding before it kills
them: a stop under torchrun must finish its step and save within that.)

Before training begins (parsing, checks, the target load, which can take minutes) there is nothing
to save: inside :func:`maybe_handle_stop_signals` with ``at_once=True`` the first signal raises
:class:`StoppedDuringStartup` where the code is, the start-up unwinds (releasing the run lock) and
the command line exits 0 saying so.

Ranks may receive the signal at different steps (or only some of them): :meth:`StopSignal.requested`
takes the maximum over all ranks, so every rank stops after the same step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
REPEAT_WINDOW_S = 1.0


class StoppedDuringStartup(BaseException):
    """A stop signal came before training began. A BaseException, as KeyboardInterrupt is, so
    that no ``except Exception`` of the start-up code turns it into an error."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name} during start-up, before training began: "
                         "nothing new was saved; run the same command again to start (or resume)")


class StopSignal:
    """The stop request of this process; installed by :func:`maybe_handle_stop_signals`."""

    def __init__(self, device: torch.device | str = "cpu", at_once: bool = False) -> None:
        self.device = torch.device(device)
        self.at_once = at_once
        self.signum: int | None = None
        self._first_at = 0.0

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            if time.monotonic() - self._first_at < REPEAT_WINDOW_S:
                return  # the same request delivered again (launcher forwarding), not a second one
            # os.write, not logging: this may interrupt a log call, and nothing after it runs
            os.write(2, f"titan_draft: second {signal.Signals(signum).name}: exiting now\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        self._first_at = time.monotonic()
        if self.at_once:
            raise StoppedDuringStartup(signum)
        logger.warning("received %s: finishing this step, saving a checkpoint, then exiting "
                       "(send it again to exit at once)", self.name)

    def requested(self) -> bool:
        """Whether any rank got a stop signal (a collective when distributed: call it on every
        rank at the same point of every step)."""
        local = self.signum is not None
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return local
        flag = torch.tensor([int(local)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and not local:
            logger.warning("another rank received a stop signal: finishing this step, saving, then exiting")
        return bool(flag.item())


@contextmanager
def maybe_handle_stop_signals(device: torch.device | str = "cpu", at_once: bool = False) -> Iterator[StopSignal]:
    """Handle SIGTERM and SIGINT as graceful stop requests inside the block (the previous handlers
    come back after it); with ``at_once`` (start-up) the first one raises
    :class:`StoppedDuringStartup`. Off the main thread, where Python cannot install handlers, the
    returned request simply never fires."""
    stop = StopSignal(device, at_once)
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {s: signal.signal(s, stop._handle) for s in STOP_SIGNALS}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
