"""The streamed safetensors writer: files safetensors itself reads back exactly, with the size and
SHA-256 of the bytes on disk."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from safetensors import safe_open

from titan_draft.data.safetensors_stream import write_safetensors


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 100, (37,), dtype=torch.int32, generator=g),
        "loss_mask": torch.rand(37, generator=g) > 0.5,
        "lengths": torch.tensor([20, 17]),
        "hidden.1": torch.randn(37, 16, generator=g).bfloat16(),
        "hidden.10": torch.randn(37, 16, generator=g).to(torch.float8_e4m3fn),
        "hidden.10.scale": torch.rand(37, generator=g),
        "wide": torch.randn(3, 2, dtype=torch.float64, generator=g),
        "transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous: written as its values
        "empty": torch.zeros(0, 4),
    }


@pytest.mark.parametrize("chunk_bytes", [7, 1 << 20])  # pieces that cut tensors mid-element, and whole ones
def test_safetensors_reads_back_what_was_written(tmp_path, chunk_bytes):
    tensors, path = _tensors(), str(tmp_path / "x.safetensors")
    size, sha256 = write_safetensors(path, tensors, {"format": "f/1", "storage": "bfloat16"}, chunk_bytes=chunk_bytes)
    data = open(path, "rb").read()
    assert size == len(data) == os.path.getsize(path) and sha256 == hashlib.sha256(data).hexdigest()
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "f/1", "storage": "bfloat16"}
        assert sorted(f.keys()) == sorted(tensors)
        for name, want in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), name


def test_what_it_cannot_write_is_named(tmp_path):
    with pytest.raises(ValueError, match="write_safetensors: c is a torch.complex64 tensor on cpu"):
        write_safetensors(str(tmp_path / "x"), {"c": torch.zeros(2, dtype=torch.complex64)})
