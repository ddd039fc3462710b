"""Device + process-group setup, ParallelDims, and the FSDP2 / AC / compile module transforms."""

from titan_draft.distributed.parallelize import apply_ac, apply_compile, apply_fsdp, apply_fsdp_frozen
from titan_draft.distributed.utils import (
    DistInfo,
    ParallelDims,
    destroy_distributed,
    dist_max,
    dist_sum,
    init_distributed,
    set_pg_timeout,
    set_seed,
)

__all__ = [
    "DistInfo",
    "ParallelDims",
    "apply_ac",
    "apply_compile",
    "apply_fsdp",
    "apply_fsdp_frozen",
    "destroy_distributed",
    "dist_max",
    "dist_sum",
    "init_distributed",
    "set_pg_timeout",
    "set_seed",
]
