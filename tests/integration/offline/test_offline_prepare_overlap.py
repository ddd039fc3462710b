"""prepare_features' overlap: features come off the device one batch behind the forward, and
several shards are written at once while the index stays an ordered prefix of whole shards."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch

import titan_draft.data.features.writer as feature_writer
from titan_draft.data.features.capture import FeatureCopier, _Slot
from titan_draft.data.features.manifest import rank_index_path
from titan_draft.data.features.writer import ShardWriter, resume_rank

H = 8


def _row(i: int):
    n = 3 + i % 4
    return [i] * n, [True] * n, i, {"hidden.2": torch.full((n, H), float(i), dtype=torch.bfloat16)}


def _fill(writer: ShardWriter, rows: int) -> None:
    for i in range(rows):
        writer.add(*_row(i))


def _slow_early_shards(monkeypatch, fail_shard: int | None = None):
    """write_shard that takes longer for earlier shards (so later ones finish first), records how
    many ran at once, and fails on ``fail_shard``."""
    real, state = feature_writer.write_shard, {"now": 0, "peak": 0}
    lock = threading.Lock()

    def write_shard(path, **kw):
        k = int(os.path.basename(path).split("-")[2].split(".")[0])
        with lock:
            state["now"] += 1
            state["peak"] = max(state["peak"], state["now"])
        try:
            time.sleep(0.05 * max(0, 4 - k))
            if k == fail_shard:
                raise OSError(28, "No space left on device")
            return real(path, **kw)
        finally:
            with lock:
                state["now"] -= 1

    monkeypatch.setattr(feature_writer, "write_shard", write_shard)
    return state


def test_shards_written_at_once_are_listed_in_order(tmp_path, monkeypatch):
    state = _slow_early_shards(monkeypatch)
    writer = ShardWriter(str(tmp_path), 0, storage="bfloat16", shard_bytes=2 * 6 * H * 2, first_shard=0, writers=3)
    _fill(writer, 20)
    written = writer.close()
    assert state["peak"] == 3  # the shards were written in parallel
    lines = [json.loads(x) for x in open(rank_index_path(str(tmp_path), 0))]
    assert [e["file"] for e in lines] == [e["file"] for e in written] == sorted(e["file"] for e in lines)
    assert len(lines) >= 6 and sum(e["rows"] for e in lines) == 20
    assert [e["file"] for e in resume_rank(str(tmp_path), 0)] == [e["file"] for e in lines]
    # the rows are in order across shards: shard k holds the rows after shard k-1's
    from safetensors.torch import load_file

    ids = torch.cat([load_file(str(tmp_path / e["file"]))["row_ids"] for e in lines])
    assert ids.tolist() == list(range(20))


def test_a_failed_shard_ends_the_listed_prefix(tmp_path, monkeypatch):
    _slow_early_shards(monkeypatch, fail_shard=1)
    writer = ShardWriter(str(tmp_path), 0, storage="bfloat16", shard_bytes=2 * 6 * H * 2, first_shard=0, writers=3)
    with pytest.raises(RuntimeError, match=r"feature shard writer \(rank 0\) failed: .*No space left on device"):
        _fill(writer, 20)
        writer.close()
    writer._pool.shutdown(wait=True)
    listed = [json.loads(x)["file"] for x in open(rank_index_path(str(tmp_path), 0))]
    assert listed == ["shard-r000-00000.safetensors"]  # later shards may be on disk, never listed
    resume_rank(str(tmp_path), 0)  # a resume removes the unlisted ones, to write them again
    assert sorted(p for p in os.listdir(tmp_path) if p.endswith(".safetensors")) == listed


def _shape(i: int) -> tuple[int, int, int]:
    return (2, 5 + 3 * (i % 3), 3)  # dynamic shapes: the pinned buffers grow, then get reused


def test_copier_hands_each_batch_out_one_push_later(device=torch.device("cpu")):
    copier = FeatureCopier(device)
    out = []

    def keep(done):  # the host copy is reused two pushes later: keep a copy of its own
        out.append((done.rows, {name: t.clone() for name, t in done.tensors.items()}))

    for i in range(6):
        with copier.forward():
            tensors = {"aux": torch.full(_shape(i), float(i), device=device)}
            if not i % 2:  # a batch may carry other tensors than the one before
                tensors["last"] = torch.full(_shape(i)[:2] + (1,), -float(i), device=device).bfloat16()
        done = copier.push(f"rows{i}", tensors)
        assert (done is None) == (i == 0)
        if done is not None:
            keep(done)
    keep(copier.flush())
    assert copier.flush() is None
    assert [r for r, _ in out] == [f"rows{i}" for i in range(6)]
    for i, (_, got) in enumerate(out):
        assert sorted(got) == (["aux"] if i % 2 else ["aux", "last"])
        assert all(t.device.type == "cpu" for t in got.values())
        assert torch.equal(got["aux"], torch.full(_shape(i), float(i)))
        if not i % 2:
            assert got["last"].dtype == torch.bfloat16
            assert torch.equal(got["last"], torch.full(_shape(i)[:2] + (1,), -float(i), dtype=torch.bfloat16))
    times = copier.forward_times()
    assert len(times) == 6 and all(t >= 0.0 for t in times)


def test_a_slot_grows_its_host_memory_and_views_it_per_batch():
    slot = _Slot(pin=False)  # pinned memory needs a CUDA build; the bookkeeping is the same
    a = slot.view("aux", torch.empty(2, 5, 3))
    assert a.shape == (2, 5, 3) and a.is_contiguous()
    b = slot.view("aux", torch.empty(1, 4, 3))  # smaller: the same memory
    assert b.shape == (1, 4, 3) and b.data_ptr() == a.data_ptr()
    c = slot.view("aux", torch.empty(2, 9, 3))  # larger: grown, to at least twice the old size
    assert c.shape == (2, 9, 3) and slot._flat["aux"].numel() == 60
    d = slot.view("aux", torch.empty(2, 5, 3, dtype=torch.bfloat16))  # another dtype: its own memory
    assert d.dtype == torch.bfloat16 and slot._flat["aux"].numel() == 30
    assert slot.view("last", torch.empty(2, 5, 1)).data_ptr() != d.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned side-stream copy needs a GPU")
def test_copier_on_cuda_reuses_its_pinned_buffers_safely():
    test_copier_hands_each_batch_out_one_push_later(torch.device("cuda"))


@pytest.mark.parametrize("kw, match", [
    ({"storage": "float16"}, r"feature storage 'float16' is not one of \('bfloat16', 'float32', 'float8_e4m3'\)"),
    ({"writers": 0}, "writers: must be >= 1, got 0"),
])
def test_a_writer_with_bad_settings_is_refused_before_any_row(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        ShardWriter(str(tmp_path), 0, **{"storage": "bfloat16", "shard_bytes": 1 << 20, "first_shard": 0, **kw})
    assert not list(tmp_path.iterdir())
