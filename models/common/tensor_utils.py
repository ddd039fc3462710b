"""Small helpers for tensors that may be FSDP2-sharded DTensors."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: ``t`` itself, or the all-gathered value of a DTensor (a collective)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_full_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy a full (unsharded) ``src`` into ``dst``, which may be a sharded DTensor.

    For a DTensor every rank must pass the same ``src``; each rank keeps its own shard without
    any communication (``src_data_rank=None``).
    """
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"shape mismatch: destination {tuple(dst.shape)}, source {tuple(src.shape)}"
        )
    if isinstance(dst, DTensor):
        src = src.to(device=dst.to_local().device, dtype=dst.dtype)
        dst.copy_(distribute_tensor(src, dst.device_mesh, dst.placements, src_data_rank=None))
    else:
        dst.copy_(src)


@torch.no_grad()
def register_frozen_tables(module: torch.nn.Module, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                           want: tuple[int, int], device_of: torch.Tensor) -> None:
    """Give a draft the target's ``[V, H]`` embedding and lm_head as non-persistent buffers
    ``target_embed`` / ``target_lm_head`` (their dtype kept, never saved: the target owns them),
    on the device of ``device_of`` (a local shard's device when it is a DTensor)."""
    for name, w in (("embed", embed_weight), ("lm_head", lm_head_weight)):
        if tuple(w.shape) != tuple(want):
            raise ValueError(f"target {name} weight has shape {tuple(w.shape)}, draft expects {tuple(want)}")
    device = device_of.to_local().device if isinstance(device_of, DTensor) else device_of.device
    module.register_buffer("target_embed", embed_weight.detach().to(device).clone(), persistent=False)
    module.register_buffer("target_lm_head", lm_head_weight.detach().to(device).clone(), persistent=False)
