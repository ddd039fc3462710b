"""HF checkpoint <-> Qwen3Model key mapping and safetensors loading."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, Shard

from models.common import copy_full_

# Buffers that some older HF checkpoints saved; the model recomputes them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_key_to_local(name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``layers.0.mlp.up_proj.weight``; ``lm_head.*``
    is kept. Any other key is returned unchanged (and will be reported as unexpected)."""
    return name[len("model.") :] if name.startswith("model.") else name


def local_key_to_hf(name: str) -> str:
    """Inverse of :func:`hf_key_to_local`."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def _checkpoint_files(folder: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of ``folder`` and, for a sharded checkpoint, the index's
    ``weight_map`` (HF key -> file name)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
        except json.JSONDecodeError as e:
            raise ValueError(f"{index} is not valid JSON: {e}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: missing or empty 'weight_map'")
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        for path in files:
            if not os.path.isfile(path):
                missing_keys = sorted(k for k, v in weight_map.items() if v == os.path.basename(path))
                raise FileNotFoundError(
                    f"{index} lists shard {os.path.basename(path)!r} (holding {missing_keys[0]!r} "
                    f"and {len(missing_keys) - 1} more keys), which is missing from {folder}"
                )
        return files, weight_map
    if os.path.isfile(single):
        return [single], None
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in target folder {folder!r}"
    )


def _shard_rows(param: DTensor) -> tuple[int, int]:
    """``(first row, row count)`` of this rank's FSDP2 shard of ``param``: dim-0 chunks of
    ``ceil(n / world)`` rows, as ``torch.chunk`` splits (the last ranks may hold fewer or none)."""
    if len(param.placements) != 1 or param.placements[0] != Shard(0):
        raise ValueError(f"only FSDP2's Shard(0) on a 1-D mesh is supported, got {param.placements}")
    n, world = param.shape[0], param.device_mesh.size()
    rank = param.device_mesh.get_local_rank()
    chunk = -(-n // world)
    start = min(rank * chunk, n)
    rows = min(chunk, n - start)
    local = param.to_local()
    if local.shape[0] != rows or tuple(local.shape[1:]) != tuple(param.shape[1:]):
        raise RuntimeError(
            f"unexpected FSDP2 shard shape {tuple(local.shape)} for global {tuple(param.shape)} "
            f"on rank {rank} of {world}"
        )
    return start, rows


def _copy_from_file(dst: torch.Tensor, f, key: str, row: int | None = None) -> None:
    """Copy checkpoint tensor ``key`` into ``dst`` (into its ``row`` along dim 0 when given). For
    an FSDP2-sharded ``dst`` only this rank's rows are read from the file (safetensors slices
    are read lazily from the mmap), so no rank ever holds the full model."""
    if row is not None:
        if isinstance(dst, DTensor):
            start, rows = _shard_rows(dst)
            if start <= row < start + rows:
                local = dst.to_local()[row - start]
                local.copy_(f.get_slice(key)[:].to(device=local.device, dtype=local.dtype))
        else:
            dst[row].copy_(f.get_tensor(key))
        return
    if isinstance(dst, DTensor):
        start, rows = _shard_rows(dst)
        if rows == 0:
            return
        src = f.get_slice(key)[start : start + rows]
        local = dst.to_local()
        local.copy_(src.to(device=local.device, dtype=local.dtype))
    else:
        copy_full_(dst, f.get_tensor(key))


def _whole_hf_key(local: str, tensor: torch.Tensor) -> list[tuple[str, int | None]]:
    return [(local_key_to_hf(local), None)]


def _whole_local_key(key: str) -> tuple[str, int | None]:
    return hf_key_to_local(key), None


@torch.no_grad()
def load_hf_state_dict(model: torch.nn.Module, folder: str, *,
                       hf_keys: Callable[[str, torch.Tensor], list[tuple[str, int | None]]] = _whole_hf_key,
                       local_key: Callable[[str], tuple[str, int | None]] = _whole_local_key) -> None:
    """Load an HF Qwen3 checkpoint folder into ``model`` (plain or FSDP2-sharded parameters).

    Every key and shape is checked before anything is copied, so a bad checkpoint leaves the
    model untouched. Raises ``KeyError`` naming unexpected/missing keys (and the file), and
    ``ValueError`` naming a key whose shape differs. With tied embeddings ``lm_head.weight`` is
    the embedding and a stored ``lm_head.weight`` is ignored.

    A family whose local tensors stack several HF tensors (mixture-of-experts: one
    ``[E, ...]`` tensor for the E experts' weights) passes ``hf_keys`` (local key, tensor ->
    the HF keys it holds, each with its row along dim 0, or None for the whole tensor) and
    ``local_key``, its inverse (HF key -> local key and row).
    """
    tied = bool(getattr(model.args, "tie_word_embeddings", False))
    if tied:
        model.tie_weights()
    expected = dict(model.state_dict())
    if tied:
        expected.pop("lm_head.weight", None)
    wanted = {(local, row): hf for local, t in expected.items() for hf, row in hf_keys(local, t)}

    plan: list[tuple[str, str, str, int | None]] = []  # (file, hf key, local key, row)
    files, weight_map = _checkpoint_files(folder)
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                if weight_map is not None and weight_map.get(key) != os.path.basename(path):
                    # a stale index would make other tools read the wrong file
                    raise KeyError(
                        f"{key!r} is stored in {path} but model.safetensors.index.json maps it to "
                        f"{weight_map.get(key)!r}"
                    )
                if key.endswith(_IGNORED_SUFFIXES):
                    continue
                local, row = local_key(key)
                if tied and local == "lm_head.weight":
                    continue
                if (local, row) not in wanted:
                    raise KeyError(f"unexpected key {key!r} in {path}")
                shape = tuple(f.get_slice(key).get_shape())
                want = tuple(expected[local].shape)[0 if row is None else 1:]
                if shape != want:
                    raise ValueError(
                        f"shape mismatch for {key!r} in {path}: checkpoint {shape}, model {want}"
                    )
                plan.append((path, key, local, row))
    seen = Counter((local, row) for _, _, local, row in plan)
    duplicates = sorted(wanted[k] for k, c in seen.items() if c > 1)
    if duplicates:
        raise KeyError(f"keys stored more than once in {folder}: {duplicates}")
    names = sorted(wanted[k] for k in set(wanted) - set(seen))
    if names:
        where = ""
        if weight_map is not None and names[0] in weight_map:
            where = f" (the index maps {names[0]!r} to {weight_map[names[0]]!r}, which lacks it)"
        raise KeyError(f"missing keys in {folder}: {names}{where}")

    for path in sorted({p for p, _, _, _ in plan}):
        with safe_open(path, framework="pt", device="cpu") as f:
            for p, key, local, row in plan:
                if p == path:
                    _copy_from_file(expected[local], f, key, row)


def load_hf_tables(folder: str, args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embedding, lm_head)`` ``[V, H]`` read alone from an HF folder (offline training needs
    the frozen tables, not the decoder): the lm_head is the embedding when the args tie them."""
    files, weight_map = _checkpoint_files(folder)
    want = ["model.embed_tokens.weight"] + ([] if args.tie_word_embeddings else ["lm_head.weight"])
    found: dict[str, torch.Tensor] = {}
    for path in files:
        if weight_map is not None and not any(weight_map.get(k) == os.path.basename(path) for k in want):
            continue
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in want:
                if key in f.keys():
                    found[key] = f.get_tensor(key)
    missing = [k for k in want if k not in found]
    if missing:
        raise KeyError(f"missing keys in {folder}: {missing}")
    shape = (args.vocab_size, args.hidden_size)
    for key, t in found.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"shape mismatch for {key!r} in {folder}: checkpoint {tuple(t.shape)}, model {shape}")
    embed = found["model.embed_tokens.weight"]
    return embed, found.get("lm_head.weight", embed)


def save_hf_checkpoint(model: torch.nn.Module, folder: str, *, dtype: torch.dtype,
                       max_shard_bytes: int = 0,
                       hf_keys: Callable[[str, torch.Tensor], list[tuple[str, int | None]]] = _whole_hf_key,
                       ) -> list[str]:
    """Write ``model``'s weights as an HF checkpoint: ``model.safetensors``, or shards plus
    ``model.safetensors.index.json`` when the weights exceed ``max_shard_bytes`` (> 0).

    Tied weights are stored once (``lm_head.weight`` omitted, as HF does). Returns the files
    written. The model must be unsharded (this is for small random targets and tests).
    ``hf_keys``: as in :func:`load_hf_state_dict` (stacked tensors are written one row per key).
    """
    tied = bool(getattr(model.args, "tie_word_embeddings", False))
    tensors = {
        hf: (v if row is None else v[row]).detach().to("cpu", dtype).contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
        for hf, row in hf_keys(k, v)
    }
    os.makedirs(folder, exist_ok=True)
    metadata = {"format": "pt"}  # transformers refuses safetensors files without it
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes <= 0 or total <= max_shard_bytes:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata=metadata)
        return ["model.safetensors"]
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(folder, name), metadata=metadata)
        weight_map.update({k: name for k in shard})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return [*names, "model.safetensors.index.json"]
