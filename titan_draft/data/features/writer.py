"""Writing one prepare rank's feature shards: rows are buffered until a shard is full, then the
shard is written by background threads while the target computes the next batches.

Resume record: ``index.rank<r>.jsonl`` gains one line per shard, in shard order, appended only
after the shard file and every earlier one are whole on disk, so the lines name complete shards
holding a prefix of the rank's rows; a shard written but not yet listed (a kill between the two,
or a later shard finished before an earlier one) is written again on resume.
"""

from __future__ import annotations

import glob
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from titan_draft.data.features.manifest import rank_index_path, read_rank_index
from titan_draft.data.features.shards import stored_dtype, write_shard

__all__ = ["ShardWriter", "resume_rank"]


def shard_name(rank: int, k: int) -> str:
    return f"shard-r{rank:03d}-{k:05d}.safetensors"


def resume_rank(folder: str, rank: int) -> list[dict[str, Any]]:
    """The shards this rank finished before, after checking they are still whole; files the index
    does not list (a shard cut short by a kill, or written but not yet listed) are removed."""
    entries = read_rank_index(folder, rank)
    for e in entries:
        path = os.path.join(folder, e["file"])
        if not os.path.isfile(path) or os.path.getsize(path) != e["bytes"]:
            raise ValueError(f"{rank_index_path(folder, rank)} lists {path}, which is missing or not "
                             f"{e['bytes']} bytes: the cache was changed since; delete the folder and prepare again")
    listed = {e["file"] for e in entries}
    for path in glob.glob(os.path.join(folder, f"shard-r{rank:03d}-*.safetensors*")):
        if os.path.basename(path) not in listed:
            os.remove(path)
    # rewrite the index without a cut-off last line
    with open(rank_index_path(folder, rank), "w") as f:
        f.writelines(json.dumps(e) + "\n" for e in entries)
    return entries


class ShardWriter:
    """Buffers rows and writes a shard once it holds ``shard_bytes`` of features.

    ``add`` takes one row's ids, mask, cache-wide id and features (CPU tensors in storage form
    under their shard names: ``feature_shards.row_features``). Up to ``writers`` shards are
    written at once by background threads (serializing, hashing and writing a shard release the
    GIL for most of their time, and one thread alone falls behind a fast target); the index still
    gains its lines in shard order, each only once every earlier shard is listed, so it always
    names a prefix of the rows. ``add`` waits while ``writers`` shards are in flight: with the one
    being filled, at most ``writers + 1`` shards are in memory. ``close`` writes the last partial
    shard and waits for all; a write error is raised by the next ``add`` or by ``close``."""

    def __init__(self, folder: str, rank: int, *, storage: str, shard_bytes: int, first_shard: int,
                 writers: int = 4):
        if writers < 1:
            raise ValueError(f"writers: must be >= 1, got {writers}")
        stored_dtype(storage)  # an unknown storage is named here, not by the first shard's thread
        self.folder, self.rank, self.storage, self.shard_bytes = folder, rank, storage, shard_bytes
        self._k = first_shard
        self._rows: list[tuple] = []
        self._bytes = 0
        self._slots = threading.BoundedSemaphore(writers)
        self._lock = threading.Lock()
        self._finished: dict[int, dict[str, Any]] = {}  # shard number -> entry, written but not yet listed
        self._next_listed = first_shard
        self._error: BaseException | None = None
        self.written: list[dict[str, Any]] = []
        self._pool = ThreadPoolExecutor(max_workers=writers, thread_name_prefix=f"feature-writer-{rank}")

    def _write(self, k: int, rows: list[tuple]) -> None:
        try:
            if self._error is not None:
                return
            entry = write_shard(
                os.path.join(self.folder, shard_name(self.rank, k)),
                input_ids=[r[0] for r in rows], loss_mask=[r[1] for r in rows], row_ids=[r[2] for r in rows],
                features={name: [r[3][name] for r in rows] for name in rows[0][3]}, storage=self.storage)
            entry["rank"] = self.rank
            with self._lock:
                self._finished[k] = entry
                self._list_finished()
        except BaseException as e:  # handed to the main thread
            with self._lock:
                self._error = self._error or e
        finally:
            self._slots.release()

    def _list_finished(self) -> None:
        """Append the index lines of the shards that now continue the listed prefix (lock held)."""
        ready = []
        while self._next_listed in self._finished:
            ready.append(self._finished.pop(self._next_listed))
            self._next_listed += 1
        if not ready:
            return
        with open(rank_index_path(self.folder, self.rank), "a") as f:
            f.writelines(json.dumps(e) + "\n" for e in ready)
            f.flush()
            os.fsync(f.fileno())
        self.written.extend(ready)

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"feature shard writer (rank {self.rank}) failed: {self._error}") from self._error

    def add(self, ids: list[int], mask: list[bool], row_id: int, features: dict[str, torch.Tensor]) -> None:
        self._check()
        self._rows.append((ids, mask, row_id, features))
        self._bytes += sum(t.numel() * t.element_size() for t in features.values())
        if self._bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._rows:
            self._slots.acquire()  # waits while `writers` shards are being written
            self._pool.submit(self._write, self._k, self._rows)
            self._k += 1
            self._rows, self._bytes = [], 0

    def close(self) -> list[dict[str, Any]]:
        self._flush()
        self._pool.shutdown(wait=True)
        self._check()
        return self.written
