"""On-disk shards of captured target features (offline mode), one safetensors file each.

A shard packs whole rows end to end (no padding on disk):

    input_ids    [T] int32          the rows' tokens, row after row
    loss_mask    [T] bool
    lengths      [R] int64          tokens per row (row r starts at sum(lengths[:r]))
    row_ids      [R] int64          a cache-wide id per row (which source row it came from)
    hidden.<i>   [T, H]             output of capture layer i (SGLang numbering)
    last_hidden  [T, H]             final-norm last hidden state (only when captured)

and, with ``float8_e4m3`` storage, ``<name>.scale [T] float32`` beside each hidden tensor: one
scale per token, so a token's values are ``float8 * scale``. One tensor per layer (rather than
the K layers concatenated) lets a cache captured for a superset of layers serve any subset.

Files are written under a temporary name, flushed to disk and renamed, so a shard either exists
whole or not at all.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from safetensors import safe_open

from titan_draft.data.features.safetensors_stream import write_safetensors

__all__ = ["FORMAT", "STORAGE_DTYPES", "ShardReader", "dequantize", "file_sha256", "hidden_key",
           "quantize", "row_features", "stored_dtype", "to_storage", "write_shard"]

FORMAT = "titan_draft.features/1"
STORAGE_DTYPES = ("bfloat16", "float32", "float8_e4m3")
"""bfloat16: what a GPU target computes in (lossless there); float32: a CPU target's exact
output; float8_e4m3: half of bfloat16's bytes, with a per-token scale."""

_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_STORED_DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float8_e4m3": torch.float8_e4m3fn}


def stored_dtype(storage: str) -> torch.dtype:
    """The dtype a storage keeps feature values in (float8's scales are float32 beside them)."""
    if storage not in _STORED_DTYPE:
        raise ValueError(f"feature storage {storage!r} is not one of {STORAGE_DTYPES}")
    return _STORED_DTYPE[storage]


def hidden_key(layer_id: int) -> str:
    return f"hidden.{layer_id}"


def quantize(x: torch.Tensor, storage: str) -> dict[str, torch.Tensor]:
    """``x [..., H]`` in storage form, on x's device: ``{"": values}`` plus ``{".scale": [...]}``
    for float8.

    float8 scales each token by its own absolute maximum, so the largest value of every token
    lands on e4m3's largest finite value and no token's range is set by another's outliers."""
    dtype = stored_dtype(storage)
    if storage != "float8_e4m3":
        return {"": x.to(dtype).contiguous()}
    x = x.float()
    amax = x.abs().amax(dim=-1)
    # divided by a tensor, not the number: CUDA multiplies by the reciprocal of a Python-number
    # divisor, which rounds differently, and a cache must not depend on where it was quantized
    scale = torch.where(amax > 0, amax / torch.full_like(amax, _E4M3_MAX), torch.ones_like(amax))
    q = (x / scale.unsqueeze(-1)).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
    return {"": q.contiguous(), ".scale": scale.contiguous()}


def to_storage(aux: torch.Tensor, last: torch.Tensor | None, num_layers: int, storage: str) -> dict[str, torch.Tensor]:
    """A captured batch in storage form, on the device it was computed on (float8 is quantized
    there: the host then copies half the bytes and does no arithmetic on them): ``"aux" [B, L, K,
    H]`` from ``aux [B, L, K*H]``, ``"last" [B, L, H]`` when given, each float8 one with its
    ``".scale"`` beside it (``"aux.scale" [B, L, K]``)."""
    out = {"aux" + k: v for k, v in quantize(aux.unflatten(-1, (num_layers, -1)), storage).items()}
    if last is not None:
        out.update({"last" + k: v for k, v in quantize(last, storage).items()})
    return out


def row_features(batch: dict[str, torch.Tensor], i: int, n: int, layer_ids: list[int]) -> dict[str, torch.Tensor]:
    """Row ``i``'s first ``n`` tokens of a ``to_storage`` batch under their shard names
    (``hidden.<id>[.scale]``, ``last_hidden[.scale]``), copied out: the batch's memory is reused."""
    row = {}
    for suffix in ("", ".scale"):
        if (aux := batch.get("aux" + suffix)) is not None:
            row.update({hidden_key(lid) + suffix: aux[i, :n, j].clone() for j, lid in enumerate(layer_ids)})
        if (last := batch.get("last" + suffix)) is not None:
            row["last_hidden" + suffix] = last[i, :n].clone()
    return row


def dequantize(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored values as ``dtype``. For float8, ``values [..., K*H]`` holds K layers side by side
    and ``scale [..., K]`` one scale per token and layer."""
    if scale is None:
        return values.to(dtype)
    k = scale.shape[-1]
    per_layer = values.to(torch.float32).unflatten(-1, (k, -1)) * scale.unsqueeze(-1)
    return per_layer.flatten(-2).to(dtype)


def write_shard(path: str, *, input_ids: list[list[int]], loss_mask: list[list[bool]], row_ids: list[int],
                features: dict[str, list[torch.Tensor]], storage: str) -> dict[str, Any]:
    """Write one shard atomically; returns its index entry (file name, rows, tokens, bytes, sha256).

    ``features`` maps each shard name (``row_features``) to one tensor per row, already in storage
    form; the rows are written one after another, not concatenated in memory first."""
    values_dtype = stored_dtype(storage)
    lengths = [len(ids) for ids in input_ids]
    for name, rows in features.items():
        want = torch.float32 if name.endswith(".scale") else values_dtype
        if rows[0].dtype != want:
            raise ValueError(f"write_shard: {name} is {rows[0].dtype}, a {storage} shard stores {want}")
        if storage == "float8_e4m3" and not name.endswith(".scale") and name + ".scale" not in features:
            raise ValueError(f"write_shard: {name} has no {name}.scale (float8 values mean nothing without it)")
    tensors: dict[str, torch.Tensor | list[torch.Tensor]] = {
        "input_ids": torch.tensor([t for ids in input_ids for t in ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for mask in loss_mask for m in mask], dtype=torch.bool),
        "lengths": torch.tensor(lengths, dtype=torch.int64),
        "row_ids": torch.tensor(row_ids, dtype=torch.int64),
        **features,
    }
    tmp = f"{path}.tmp"
    size, sha256 = write_safetensors(tmp, tensors, {"format": FORMAT, "storage": storage})
    os.replace(tmp, path)  # the shard appears whole or not at all
    return {"file": os.path.basename(path), "rows": len(lengths), "tokens": sum(lengths), "bytes": size,
            "sha256": sha256}


def file_sha256(path: str, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class ShardReader:
    """Random access to the rows of one shard: only the requested rows' bytes are read (the file
    is memory-mapped by safetensors), so a shuffled walk over a shard never loads it whole."""

    def __init__(self, path: str, layer_ids: list[int], need_last_hidden: bool):
        self.path = path
        self._f = safe_open(path, framework="pt", device="cpu")
        meta = self._f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not a feature shard (format {meta.get('format')!r}, expected {FORMAT!r})")
        self.storage = meta.get("storage")
        keys = set(self._f.keys())
        self._names = [hidden_key(i) for i in layer_ids] + (["last_hidden"] if need_last_hidden else [])
        missing = [n for n in self._names if n not in keys]
        if missing:
            raise ValueError(f"{path}: shard lacks {missing} (captured: {sorted(k for k in keys if 'hidden' in k)})")
        self._scaled = self.storage == "float8_e4m3"
        self.lengths = self._f.get_tensor("lengths")
        self.row_ids = self._f.get_tensor("row_ids")
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), self.lengths.cumsum(0)]).tolist()
        self._ids = self._f.get_slice("input_ids")
        self._mask = self._f.get_slice("loss_mask")
        self._slices = {n: self._f.get_slice(n) for n in self._names}
        self._scales = {n: self._f.get_slice(n + ".scale") for n in self._names} if self._scaled else {}
        self.num_layers = len(layer_ids)

    def __len__(self) -> int:
        return len(self.lengths)

    def row(self, r: int) -> dict[str, Any]:
        """Row ``r``: ids and mask (lists, what the collate takes), ``hidden [L, K*H]`` in the
        storage dtype (``hidden_scale [L, K]`` for float8), ``last_hidden [L, H]`` if asked
        (``last_hidden_scale [L, 1]``)."""
        a, b = self.offsets[r], self.offsets[r + 1]
        out: dict[str, Any] = {
            "input_ids": self._ids[a:b].tolist(),
            "loss_mask": self._mask[a:b].tolist(),
            "row_id": int(self.row_ids[r]),
        }
        aux_names = self._names[: self.num_layers]
        out["hidden"] = torch.cat([self._slices[n][a:b] for n in aux_names], dim=-1)
        if self._scaled:
            out["hidden_scale"] = torch.stack([self._scales[n][a:b] for n in aux_names], dim=-1)
        if len(self._names) > self.num_layers:
            out["last_hidden"] = self._slices["last_hidden"][a:b]
            if self._scaled:
                out["last_hidden_scale"] = self._scales["last_hidden"][a:b].unsqueeze(-1)
        return out
