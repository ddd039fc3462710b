"""The streamed safetensors writer: files safetensors itself reads back exactly, with the size and
SHA-256 of the bytes on disk."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from safetensors import safe_open

from titan_draft.data.features.safetensors_stream import write_safetensors


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


def test_a_list_of_pieces_is_written_as_their_concatenation(tmp_path):
    g = torch.Generator().manual_seed(1)
    pieces = [torch.randn(n, 6, generator=g).bfloat16() for n in (3, 0, 5, 1)]
    scales = [torch.rand(n, generator=g) for n in (3, 0, 5, 1)]
    path = str(tmp_path / "x.safetensors")
    size, sha256 = write_safetensors(path, {"h": pieces, "h.scale": scales, "one": [pieces[2]]}, chunk_bytes=10)
    # byte for byte the file of the concatenated tensors
    joined = str(tmp_path / "y.safetensors")
    assert (size, sha256) == write_safetensors(joined, {"h": torch.cat(pieces), "h.scale": torch.cat(scales),
                                                        "one": pieces[2]})
    assert open(path, "rb").read() == open(joined, "rb").read()
    with safe_open(path, framework="pt") as f:
        assert torch.equal(f.get_tensor("h"), torch.cat(pieces)) and f.get_tensor("h").shape == (9, 6)


@pytest.mark.parametrize("pieces, match", [
    ([torch.zeros(2, 4), torch.zeros(2, 5)], r"h's pieces differ \(torch.float32 \[2, 4\] and torch.float32 \[2, 5\]\)"),
    ([torch.zeros(2, 4), torch.zeros(2, 4).bfloat16()], r"h's pieces differ .* torch.bfloat16 \[2, 4\]"),
    ([], "h is an empty list of pieces"),
])
def test_pieces_that_do_not_fit_together_are_named(tmp_path, pieces, match):
    with pytest.raises(ValueError, match=match):
        write_safetensors(str(tmp_path / "x"), {"h": pieces})
    assert not os.path.exists(tmp_path / "x")
