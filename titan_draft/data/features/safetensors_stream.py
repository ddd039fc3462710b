"""A safetensors file written straight from the tensors' memory, hashed on the way out.

``safetensors.torch.save`` first builds the whole file as one ``bytes`` object (a copy of every
tensor), and hashing that object afterwards reads it all again. A feature shard is a gigabyte, and
prepare_features writes one every few forward passes, so those two passes cost as much host time
as the disk write itself (docs/performance.md, offline mode). Here the header is written, then each
tensor's bytes in chunks from a zero-copy view, each chunk fed to SHA-256 as it goes.

The layout is safetensors' own: an 8-byte little-endian header length, the JSON header padded with
spaces to a multiple of 8, then the tensors' data in the header's order. That order is larger
elements first, then by name, so every tensor starts aligned to its element size. safetensors
orders its own files slightly differently (by dtype) and writes metadata in hash-map order;
readers take any order. ``tests/unit/data/features/test_safetensors_stream.py`` reads the files back with
safetensors itself.

A tensor may also be given as a list of pieces that share a dtype and all but the first dimension:
the file holds them concatenated along it, written piece after piece, so a shard built from many
rows is never concatenated in memory (one pass over a gigabyte less per shard).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import torch

_DTYPE_NAMES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
    torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
    torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
CHUNK_BYTES = 64 << 20  # hash and write in pieces that stay in the CPU's caches' neighbourhood


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (a contiguous CPU tensor viewed as uint8)."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _pieces(name: str, value: torch.Tensor | list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """A tensor's pieces and the shape they make together (checked: one dtype, CPU, same trailing
    dimensions)."""
    pieces = [value] if isinstance(value, torch.Tensor) else list(value)
    if not pieces:
        raise ValueError(f"write_safetensors: {name} is an empty list of pieces")
    first = pieces[0]
    for t in pieces:
        if t.dtype not in _DTYPE_NAMES or t.device.type != "cpu":
            raise ValueError(f"write_safetensors: {name} is a {t.dtype} tensor on {t.device}; "
                             f"only CPU tensors of {sorted(map(str, _DTYPE_NAMES))} are written")
        if len(pieces) > 1 and (t.dtype != first.dtype or t.dim() == 0 or t.shape[1:] != first.shape[1:]):
            raise ValueError(f"write_safetensors: {name}'s pieces differ ({first.dtype} {list(first.shape)} "
                             f"and {t.dtype} {list(t.shape)}); they must differ only in the first dimension")
    if len(pieces) == 1:
        return pieces, list(first.shape)
    return pieces, [sum(t.shape[0] for t in pieces), *first.shape[1:]]


def write_safetensors(path: str, tensors: dict[str, torch.Tensor | list[torch.Tensor]],
                      metadata: dict[str, str] | None = None, *, chunk_bytes: int = CHUNK_BYTES) -> tuple[int, str]:
    """Write ``tensors`` to ``path`` (flushed and fsynced); returns ``(file bytes, sha256 hex)``.
    A list stands for its pieces concatenated along the first dimension."""
    parts = {name: _pieces(name, value) for name, value in tensors.items()}
    order = sorted(parts, key=lambda k: (-parts[k][0][0].element_size(), k))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        pieces, shape = parts[name]
        size = sum(t.numel() for t in pieces) * pieces[0].element_size()
        header[name] = {"dtype": _DTYPE_NAMES[pieces[0].dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    with open(path, "wb") as f:
        for piece in (struct.pack("<Q", len(text)), text):
            f.write(piece)
            digest.update(piece)
        for name in order:
            for t in parts[name][0]:
                raw = _raw(t)
                for start in range(0, len(raw), chunk_bytes):
                    piece = raw[start : start + chunk_bytes]
                    f.write(piece)
                    digest.update(piece)  # hashlib releases the GIL on large pieces: writers run in parallel
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(text) + offset, digest.hexdigest()
