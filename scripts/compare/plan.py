"""What scripts/compare_drafts.py measures of a training job and how it sizes the real run.

A job's step times and memory peaks are read back from its TensorBoard scalars (``perf/step_time_s``
is the mean step of each logged window, ``memory/*`` the window's peak), so nothing in the trainer
is special to the comparison. The budget arithmetic is pure: a calibration job of N steps that took
W seconds from start to exit, with a median step of m seconds once warm, spent W - N * m on
everything that is not a step (start-up, target load, compile, warm-up, the last checkpoint, the
export). The real run gets the steps that fit what is left of the budget.
"""

from __future__ import annotations

import math
import os
import statistics
from dataclasses import asdict, dataclass

# TensorBoard tags of the trainer's metrics logger (titan_draft/components/metrics.py)
STEP_TIME_TAG = "perf/step_time_s"
MEMORY_TAGS = ("memory/max_allocated_gib", "memory/max_reserved_gib", "memory/peak_rss_gib")


class BudgetError(ValueError):
    """A budget the comparison cannot honour; its message is the one line the user sees."""


@dataclass
class RunMetrics:
    """What a finished job logged: the mean step time of each logged window (keyed by the step
    that closed it) and the largest memory peak of each kind over the run (GiB)."""

    step_times: dict[int, float]
    peaks: dict[str, float]

    def median_step_s(self, skip_through: int) -> float:
        """Median of the logged step times after step ``skip_through`` (compile and warm-up)."""
        kept = [t for step, t in sorted(self.step_times.items()) if step > skip_through]
        if not kept:
            raise BudgetError(f"no step time was logged after step {skip_through} "
                              f"(logged steps: {sorted(self.step_times)})")
        return statistics.median(kept)


def read_run_metrics(tb_dir: str) -> RunMetrics:
    """Step times and memory peaks from the TensorBoard folder of one job (``<dump>/tb/run``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(tb_dir):
        raise BudgetError(f"{tb_dir}: no TensorBoard logs (the job needs metrics.enable_tensorboard = true)")
    events = EventAccumulator(tb_dir, size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags().get("scalars", []))
    if STEP_TIME_TAG not in tags:
        raise BudgetError(f"{tb_dir}: no {STEP_TIME_TAG} scalars (did the job log any step?)")
    # a resumed job rewrites the steps after its checkpoint: the last value of a step is the one kept
    times = {e.step: e.value for e in events.Scalars(STEP_TIME_TAG)}
    peaks = {tag.split("/", 1)[1]: max(e.value for e in events.Scalars(tag)) for tag in MEMORY_TAGS if tag in tags}
    return RunMetrics(step_times=times, peaks=peaks)


@dataclass
class Calibration:
    """A short job of the draft's real settings, timed from start to exit. With checkpoints on it
    saves once before its end (after step ``save_step``), so the step after it costs a save more."""

    steps: int
    warmup: int
    """Leading steps left out of the median (compile, autotuning, first allocations)."""
    wall_s: float
    median_step_s: float
    save_step: int | None = None
    save_s: float = 0.0
    """What the periodic save cost the step after it (0 without checkpoints)."""

    @property
    def setup_s(self) -> float:
        """Everything in the job that is not a warm step or the periodic save: start-up, target
        load, compile and warm-up, the final checkpoint and the export."""
        return max(0.0, self.wall_s - self.steps * self.median_step_s - self.save_s)

    def job_s(self, steps: int, save_interval: int) -> float:
        """The predicted wall clock of a job of ``steps`` steps that saves every ``save_interval``
        (0: never; the save at the last step is part of the setup)."""
        saves = (steps - 1) // save_interval if save_interval > 0 else 0
        return self.setup_s + steps * self.median_step_s + saves * self.save_s

    def to_json(self) -> dict:
        return {**asdict(self), "setup_s": self.setup_s}

    @classmethod
    def from_json(cls, record: dict) -> Calibration:
        return cls(steps=record["steps"], warmup=record["warmup"], wall_s=record["wall_s"],
                   median_step_s=record["median_step_s"], save_step=record.get("save_step"),
                   save_s=record.get("save_s", 0.0))


def calibration_save_step(steps: int, warmup: int) -> int:
    """Where the calibration job saves before its end: halfway through its warm steps."""
    return warmup + (steps - warmup) // 2


def build_calibration(metrics: RunMetrics, steps: int, warmup: int, wall_s: float,
                      save_step: int | None = None) -> Calibration:
    """The calibration of a job of ``steps`` steps, each logged; ``save_step``: the step after which
    it saved a checkpoint (None: it saved only at its end)."""
    if max(metrics.step_times, default=0) < steps:
        raise BudgetError(f"the calibration job logged steps up to {max(metrics.step_times, default=0)}, "
                          f"not {steps}: it did not finish")
    after_save = None if save_step is None else save_step + 1
    warm = RunMetrics({k: v for k, v in metrics.step_times.items() if k != after_save}, metrics.peaks)
    median = warm.median_step_s(warmup)
    save_s = 0.0 if after_save is None else max(0.0, metrics.step_times[after_save] - median)
    return Calibration(steps=steps, warmup=warmup, wall_s=wall_s, median_step_s=median,
                       save_step=save_step, save_s=save_s)


def choose_steps(label: str, budget_s: float, calibration: Calibration, margin: float,
                 save_interval: int = 0) -> int:
    """Training steps whose whole job (start to exit) fits ``budget_s`` less ``margin`` of it.

    The steps cost the calibration's warm median each, a periodic save (every ``save_interval``
    steps) what the calibration's cost, and the setup (:attr:`Calibration.setup_s`) is paid once.
    A budget that leaves less than one step after the setup is refused in one line.
    """
    if budget_s <= 0:
        raise BudgetError(f"{label}: the budget must be > 0 minutes, got {budget_s / 60:g}")
    if not 0 <= margin < 1:
        raise BudgetError(f"{label}: the margin must be in [0, 1), got {margin:g}")
    step = calibration.median_step_s
    if step <= 0:
        raise BudgetError(f"{label}: the calibration measured a median step of {step * 1e3:.3f} ms")
    usable = budget_s * (1.0 - margin)
    steps = math.floor((usable - calibration.setup_s) / step)
    while steps >= 1 and calibration.job_s(steps, save_interval) > usable:
        steps -= 1  # the periodic saves: at most one fewer step per save
    if steps < 1:
        need_min = math.ceil(100 * (calibration.setup_s + step) / (1.0 - margin) / 60) / 100  # rounded up
        raise BudgetError(
            f"{label}: a budget of {budget_s / 60:.2f} min leaves no time to train: start-up, compile and "
            f"exit took {calibration.setup_s / 60:.2f} min of the calibration job ({calibration.steps} steps "
            f"of {step * 1e3:.1f} ms in {calibration.wall_s / 60:.2f} min); give --minutes {need_min:.2f} "
            f"or more")
    return steps


def summarize_run(metrics: RunMetrics, steps: int, wall_s: float, attempts: int) -> dict:
    """The real run's record: its steps, wall clock (every attempt, start to exit), the median of
    its logged windows after step 1 (step 1 is a window of its own and holds the compile) and
    its memory peaks."""
    skip = 1 if max(metrics.step_times) > 1 else 0  # a one-step run has only its compile step
    return {"steps": steps, "wall_s": wall_s, "attempts": attempts,
            "median_step_ms": 1e3 * metrics.median_step_s(skip), "peaks_gib": metrics.peaks}
