"""Device and process-group setup, the parallel layout, seeding and small collective helpers."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """Where this process runs and how it talks to the others (printed at start)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    launcher: str
    """'torchrun' (env:// rendezvous), 'single-process' (no launcher: a one-rank group on an
    in-process store) or 'existing' (the caller had already initialized the default group)."""

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def select_device_type(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("job.device = 'cuda' but no CUDA device is visible to this process")
    if requested not in ("cuda", "cpu"):
        raise ValueError(f"job.device = {requested!r} must be auto, cuda or cpu")
    return requested


def init_distributed(job_config: Any) -> DistInfo:
    """Pick the device, then join (or create) the default process group.

    Under torchrun the group rendezvous through env:// (RANK, WORLD_SIZE, MASTER_ADDR...). Without
    a launcher a one-rank group is created on an in-process HashStore, so that FSDP2, DCP and the
    collective helpers run the same code in ``python -m titan_draft.train`` as under torchrun.
    """
    device_type = select_device_type(job_config.job.device)
    backend = "nccl" if device_type == "cuda" else "gloo"
    timeout = timedelta(seconds=job_config.comm.init_timeout_seconds)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))

    if device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} "
                               "CUDA devices are visible (more processes per node than GPUs?)")
        # set before the group exists, so NCCL binds this rank's communicator to its own GPU
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    device_id = device if device_type == "cuda" else None

    if dist.is_initialized():
        launcher = "existing"
        rank, world_size = dist.get_rank(), dist.get_world_size()
        backend = str(dist.get_backend())
    elif launched:
        launcher = "torchrun"
        dist.init_process_group(backend=backend, timeout=timeout, device_id=device_id)
    else:
        launcher = "single-process"
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout, device_id=device_id)
        rank, world_size = 0, 1
    info = DistInfo(rank, world_size, local_rank, device, backend, launcher)
    logger.info("distributed: %s", info)
    return info


def set_pg_timeout(timeout_seconds: int) -> None:
    """Switch the default group from the (long) init timeout to the training timeout.

    Everyone reaches this point first, or a rank still initializing under the old timeout could
    make a fast rank's first collective time out under the new, shorter one.
    """
    if not dist.is_initialized():
        return
    dist.barrier()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # private API; keep the init timeout rather than fail
        logger.warning("this torch has no _set_pg_timeout; keeping the init timeout")
        return
    set_timeout(timedelta(seconds=timeout_seconds), None)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class ParallelDims:
    """The parallel layout: data parallel over all ranks, as FSDP2 over a 1-D ``dp_shard`` mesh,
    or HSDP over a 2-D ``(dp_replicate, dp_shard)`` mesh (parameters sharded within a group of
    ``dp_shard`` ranks, e.g. one node, and replicated across the ``dp_replicate`` groups, whose
    gradients are all-reduced). Every rank reads different data either way."""

    dp_shard: int
    world_size: int
    dp_replicate: int = 1
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be >= 1, got {self.world_size}")
        if self.dp_replicate < 1 or self.world_size % self.dp_replicate:
            raise ValueError(
                f"parallelism.data_parallel_replicate_degree = {self.dp_replicate} must be >= 1 and "
                f"divide the world size {self.world_size}")
        if self.dp_shard == -1:
            self.dp_shard = self.world_size // self.dp_replicate
        if self.dp_shard < 1 or self.dp_shard * self.dp_replicate != self.world_size:
            raise ValueError(
                f"parallelism.data_parallel_shard_degree = {self.dp_shard} times "
                f"data_parallel_replicate_degree = {self.dp_replicate} must equal the world size "
                f"{self.world_size} (shard -1: the world size / replicate degree)")

    @classmethod
    def from_config(cls, job_config: Any, world_size: int) -> "ParallelDims":
        p = job_config.parallelism
        return cls(dp_shard=p.data_parallel_shard_degree, world_size=world_size,
                   dp_replicate=p.data_parallel_replicate_degree)

    @property
    def dp_shard_enabled(self) -> bool:
        """More than one shard (float8 all-gather and gradient reduction only matter then)."""
        return self.dp_shard > 1

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_size(self) -> int:
        """Ranks that see different data (all of them)."""
        return self.dp_shard * self.dp_replicate

    def build_mesh(self, device_type: str) -> DeviceMesh:
        if self.hsdp:
            self._mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard),
                                          mesh_dim_names=("dp_replicate", "dp_shard"))
        else:
            self._mesh = init_device_mesh(device_type, (self.dp_shard,), mesh_dim_names=("dp_shard",))
        return self._mesh

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh() has not been called")
        return self._mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` takes: 2-D for HSDP (replicate, shard), else 1-D."""
        mesh = self.world_mesh
        return mesh[("dp_replicate", "dp_shard")] if self.hsdp else mesh["dp_shard"]

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D ``dp_shard`` mesh: a frozen module (the target) is sharded within each
        replicate group only, since it has no gradients to all-reduce across groups."""
        return self.world_mesh["dp_shard"]


def set_seed(seed: int) -> None:
    """Seed every generator a run draws from (Python, NumPy if present, torch CPU and CUDA)."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def _all_reduce(value: torch.Tensor | float, op: dist.ReduceOp, group=None) -> torch.Tensor | float:
    is_tensor = isinstance(value, torch.Tensor)
    t = value.detach().clone() if is_tensor else torch.tensor(float(value), dtype=torch.float64)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return t if is_tensor else float(value)
    home = t.device
    backend = str(dist.get_backend(group))
    # NCCL only reduces CUDA tensors; a gloo-backed group (or a cpu:gloo sub-backend) takes CPU ones
    if "nccl" in backend and "cpu:" not in backend and home.type != "cuda":
        t = t.to(torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(t, op=op, group=group)
    t = t.to(home)
    return t if is_tensor else t.item()


def dist_sum(value: torch.Tensor | float, group=None) -> torch.Tensor | float:
    """Sum over the ranks of ``group`` (a new tensor, or a float for a float); a no-op copy
    without a process group or with one rank."""
    return _all_reduce(value, dist.ReduceOp.SUM, group)


def dist_max(value: torch.Tensor | float, group=None) -> torch.Tensor | float:
    """Maximum over the ranks of ``group``; see ``dist_sum``."""
    return _all_reduce(value, dist.ReduceOp.MAX, group)
