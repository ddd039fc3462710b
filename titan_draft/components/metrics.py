"""Training metrics: one console line per log step and TensorBoard scalars, on rank 0.

The trainer reduces its numbers over micro-batches and DP ranks and hands them over as plain
floats; this module adds what it can measure itself (device memory, ETA) and formats everything.

MFU convention: ``mfu`` is a percentage of the *spec* dense bf16 peak (``get_peak_flops``). On the
H200 the project measured about 790 TFLOP/s achievable for large bf16 GEMMs against the 989 TFLOP/s
spec, so about 80 % MFU is the practical ceiling there, not 100 %.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import re
import resource
import sys
import time
from typing import Any

import torch

from titan_draft.config.job_config import Metrics as MetricsConfig

logger = logging.getLogger(__name__)

_GIB = 1024**3

# (pattern on torch.cuda.get_device_name(), dense bf16 FLOP/s from the vendor spec sheet).
# Order matters: the first match wins (H200 before H20, PCIe/NVL variants before plain H100).
_PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    (r"\bB200\b", 2.25e15),
    (r"\bGB200\b", 2.5e15),
    (r"\bH200\b.*\bNVL\b", 835e12),
    (r"\bG?H200\b", 989e12),  # SXM, and the GH200's GPU
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b", 989e12),  # SXM
    (r"\bH800\b", 989e12),
    (r"\bH20\b", 148e12),
    (r"\bA100\b", 312e12),
    (r"\bA800\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bMI325X\b", 1307e12),
    (r"\bMI300X\b", 1307e12),
]


def due_every(step: int, total_steps: int, every: int) -> bool:
    """Whether a periodic measurement (``[eval]``, ``[validation]``) runs after ``step``: every
    ``every`` steps (0: never on the way) and always after the last one."""
    return step == total_steps or (every > 0 and step % every == 0)


class StepSums:
    """A step's sums over its micro-batches (training) or batches (validation): the loss, its
    denominator and every metric's (numerator, denominator), in float64, so that one all-reduce of
    :meth:`flat` gives the global figures and :func:`metric_ratios` divides them at the end."""

    def __init__(self, device: torch.device):
        self.loss = torch.zeros(2, dtype=torch.float64, device=device)
        self.metrics: dict[str, torch.Tensor] = {}

    def add(self, out) -> None:
        """Add one forward's ``loss_sum``, ``loss_denominator`` and ``metrics`` (detached)."""
        self.loss += torch.stack([out.loss_sum.detach().double(), out.loss_denominator.detach().double()])
        for name, (num, den) in out.metrics.items():
            pair = torch.stack([num.detach().double(), den.detach().double()])
            self.metrics[name] = self.metrics[name] + pair if name in self.metrics else pair

    def flat(self) -> tuple[torch.Tensor, list[str]]:
        """``([loss_sum, loss_denominator, num_0, den_0, ...], names)``, metrics in name order."""
        names = sorted(self.metrics)
        return torch.cat([self.loss] + [self.metrics[n] for n in names]), names


def metric_ratios(flat: list[float], names: list[str]) -> dict[str, float]:
    """``{name: numerator / denominator}`` of a step's reduced sums ``flat = [loss_sum,
    loss_denominator, num_0, den_0, num_1, den_1, ...]`` (metrics in ``names`` order; an empty
    denominator gives 0)."""
    out = {}
    for i, name in enumerate(names):
        num, den = flat[2 + 2 * i], flat[3 + 2 * i]
        out[name] = num / den if den > 0 else 0.0
    return out


def get_peak_flops(device_name: str) -> float | None:
    """Spec dense bf16 FLOP/s of a GPU by name, or None when unknown (MFU is then not shown)."""
    for pattern, flops in _PEAK_BF16_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return flops
    return None


class DeviceMemoryMonitor:
    """Peak memory since the last reset: CUDA allocator stats on GPU, process RSS on CPU."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        if device_type == "cuda":
            self.device = torch.cuda.current_device()
            self.device_name = torch.cuda.get_device_name(self.device)
            self.capacity_bytes = torch.cuda.get_device_properties(self.device).total_memory
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.device = None
            self.device_name = "cpu"
            self.capacity_bytes = 0

    def get_peak_stats(self) -> dict[str, float]:
        """GPU: ``max_allocated_gib``, ``max_reserved_gib``, their ``_pct`` of capacity,
        ``num_alloc_retries``, ``num_ooms``. CPU: ``rss_gib`` and ``peak_rss_gib`` (the peak
        is since process start: the kernel offers no reset)."""
        if self.device_type == "cuda":
            stats = torch.cuda.memory_stats(self.device)
            allocated = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            return {
                "max_allocated_gib": allocated / _GIB,
                "max_reserved_gib": reserved / _GIB,
                "max_allocated_pct": 100.0 * allocated / self.capacity_bytes,
                "max_reserved_pct": 100.0 * reserved / self.capacity_bytes,
                "num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
                "num_ooms": float(stats.get("num_ooms", 0)),
            }
        # ru_maxrss is in KiB on Linux and in bytes on macOS.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_bytes = peak if sys.platform == "darwin" else peak * 1024
        current = _current_rss_bytes()
        # The kernel updates ru_maxrss lazily; the current RSS can be a few pages ahead of it.
        return {"rss_gib": current / _GIB, "peak_rss_gib": max(peak_bytes, current) / _GIB}

    def reset_peak_stats(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        # No procfs (macOS): the peak is the best available figure.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def _format_duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return str(datetime.timedelta(seconds=seconds))


# TensorBoard groups scalars by the prefix before "/".
_TB_GROUPS = {
    "lr": "optim",
    "grad_norm": "optim",
    "tokens_per_s": "perf",
    "padding_fraction": "perf",
    "samples_per_s": "perf",
    "mfu": "perf",
    "data_wait_s": "perf",
    "step_time_s": "perf",
}


def _tb_tag(key: str) -> str:
    if "/" in key:
        return key
    return f"{_TB_GROUPS.get(key, 'train')}/{key}"


@dataclasses.dataclass
class LogWindow:
    """Counters since the last logged step; throughput is averaged over this window."""

    start: float = dataclasses.field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: int = 0
    """Real (non-padding) tokens."""
    positions: int = 0
    """Row positions, padding included."""
    samples: int = 0
    """Conversations (a packed row holds several)."""
    data_wait: float = 0.0


class MetricsLogger:
    """Console line + TensorBoard scalars at step 1, every ``log_freq`` steps and the last step.

    Every rank may call ``log``; only rank 0 prints and writes (other ranks only reset their
    memory peaks, so the next window's peak is per window everywhere).
    """

    def __init__(self, cfg: MetricsConfig, dump_folder: str, rank: int, device_type: str) -> None:
        if cfg.log_freq < 1:
            raise ValueError(f"metrics.log_freq must be >= 1, got {cfg.log_freq}")
        self.cfg = cfg
        self.rank = rank
        self.device_type = device_type
        self.memory_monitor = DeviceMemoryMonitor(device_type)
        self.peak_flops = (
            get_peak_flops(self.memory_monitor.device_name) if device_type == "cuda" else None
        )
        if device_type == "cuda" and self.peak_flops is None and rank == 0:
            logger.warning(
                "metrics: unknown peak FLOP/s for %r, MFU will not be shown",
                self.memory_monitor.device_name,
            )
        self.writer = None
        self.tb_dir: str | None = None
        if rank == 0 and cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # One run folder for the job, across resumes (see resume_at), not one per start.
            self.tb_dir = os.path.join(dump_folder, cfg.save_tb_folder, "run")
            self.writer = SummaryWriter(self.tb_dir)
            logger.info("metrics: TensorBoard logs in %s", self.tb_dir)
        self._last_log: tuple[int, float] | None = None  # (step, time.perf_counter())

    def resume_at(self, step: int) -> None:
        """The run goes on from checkpoint ``step``: points an interrupted process logged after it
        are dropped from TensorBoard (its purge_step), so the resumed curve replaces them."""
        if self.writer is None or step <= 0:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(self.tb_dir, purge_step=step + 1)

    def should_log(self, step: int, total_steps: int | None = None) -> bool:
        """Same answer on every rank (the trainer may reduce metrics only when it is True)."""
        return step == 1 or step % self.cfg.log_freq == 0 or step == total_steps

    def _eta_seconds(self, step: int, total_steps: int, step_time_s: float | None) -> float | None:
        now = time.perf_counter()
        per_step = step_time_s
        if self._last_log is not None and step > self._last_log[0]:
            # Wall time over the whole window also counts logging, checkpoints and evals.
            per_step = (now - self._last_log[1]) / (step - self._last_log[0])
        self._last_log = (step, now)
        if per_step is None:
            return None
        return per_step * max(0, total_steps - step)

    def log(self, step: int, scalars: dict[str, Any], total_steps: int) -> str | None:
        """Log ``scalars`` (floats or 0-d tensors) for ``step``; returns the console line on rank 0.

        Known keys: loss, acc, accept_len, lr, grad_norm, tokens_per_s, padding_fraction,
        anchor_fill, samples_per_s, mfu (in %, GPU only), data_wait_s, step_time_s (both per
        optimizer step). Other keys (acc_k, ...) go to TensorBoard only.
        """
        values = {k: float(v) for k, v in scalars.items() if v is not None}
        if self.device_type != "cuda" or self.peak_flops is None:
            values.pop("mfu", None)  # meaningless without a known GPU peak
        memory = self.memory_monitor.get_peak_stats()
        self.memory_monitor.reset_peak_stats()
        if self.rank != 0:
            return None
        eta = self._eta_seconds(step, total_steps, values.get("step_time_s"))

        parts = [f"step {step}/{total_steps}"]
        fmt = [
            ("loss", "loss {:.4f}"),
            ("acc", "acc {:.4f}"),
            ("accept_len", "accept_len {:.3f}"),
            ("lr", "lr {:.3e}"),
            ("grad_norm", "grad_norm {:.4f}"),
            ("tokens_per_s", "tok/s {:,.0f}"),
            ("padding_fraction", "pad {:.1%}"),
            # drafts that train sampled anchors: the share of their (static) slots filled, so a
            # num_anchors larger than the rows' candidates shows as compute spent on empty slots
            ("anchor_fill", "anchors {:.0%}"),
            ("samples_per_s", "samples/s {:.2f}"),
            ("mfu", "mfu {:.2f}%"),
        ]
        parts += [template.format(values[key]) for key, template in fmt if key in values]
        if self.device_type == "cuda":
            parts.append(
                "mem {max_allocated_gib:.2f}/{max_reserved_gib:.2f} GiB "
                "({max_allocated_pct:.1f}%/{max_reserved_pct:.1f}%)".format(**memory)
            )
        else:
            parts.append("rss {rss_gib:.2f} GiB".format(**memory))
        if "data_wait_s" in values:
            data = f"data {1e3 * values['data_wait_s']:.1f} ms"
            if values.get("step_time_s"):
                data += f" ({100.0 * values['data_wait_s'] / values['step_time_s']:.1f}%)"
            parts.append(data)
        if eta is not None:
            parts.append(f"eta {_format_duration(eta)}")
        line = "  ".join(parts)
        logger.info(line)

        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(_tb_tag(key), value, step)
            for key, value in memory.items():
                self.writer.add_scalar(f"memory/{key}", value, step)
            if "data_wait_s" in values and values.get("step_time_s"):
                self.writer.add_scalar(
                    "perf/data_wait_pct", 100.0 * values["data_wait_s"] / values["step_time_s"], step
                )
            self.writer.flush()
        return line

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """TensorBoard only (rank 0), for results that print their own report (the eval)."""
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(_tb_tag(key), float(value), step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
