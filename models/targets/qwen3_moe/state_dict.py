"""HF Qwen3-MoE checkpoint <-> Qwen3MoeModel keys: HF stores one tensor per expert
(``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``), the model one stacked ``[E, ...]``
tensor per projection (``layers.{i}.mlp.experts.gate_proj``)."""

from __future__ import annotations

import re

import torch

from models.targets.qwen3.state_dict import (
    hf_key_to_local,
    load_hf_state_dict,
    local_key_to_hf,
    save_hf_checkpoint,
)

_HF_EXPERT = re.compile(r"^model\.(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LOCAL_EXPERTS = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")


def hf_keys(local: str, tensor: torch.Tensor) -> list[tuple[str, int | None]]:
    """The HF keys that local tensor ``local`` holds, each with its row (None: the whole tensor)."""
    m = _LOCAL_EXPERTS.match(local)
    if m is None:
        return [(local_key_to_hf(local), None)]
    return [(f"model.{m[1]}.{e}.{m[2]}.weight", e) for e in range(tensor.shape[0])]


def local_key(key: str) -> tuple[str, int | None]:
    """HF key -> (local key, row of the stacked tensor or None)."""
    m = _HF_EXPERT.match(key)
    if m is None:
        return hf_key_to_local(key), None
    return f"{m[1]}.{m[3]}", int(m[2])


def load_moe_state_dict(model: torch.nn.Module, folder: str) -> None:
    """Load an HF Qwen3-MoE folder into ``model`` (plain or FSDP2-sharded: each rank reads only
    its experts), with every key and shape checked first (``load_hf_state_dict``)."""
    load_hf_state_dict(model, folder, hf_keys=hf_keys, local_key=local_key)


def save_moe_checkpoint(model: torch.nn.Module, folder: str, *, dtype: torch.dtype,
                        max_shard_bytes: int = 0) -> list[str]:
    """Write ``model`` (unsharded) as an HF Qwen3-MoE checkpoint: one tensor per expert."""
    return save_hf_checkpoint(model, folder, dtype=dtype, max_shard_bytes=max_shard_bytes, hf_keys=hf_keys)
