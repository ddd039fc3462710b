"""Checkpoints that prove themselves: a record of every file's size and SHA-256, written last.

DCP's ``.metadata`` says a save *finished*; it cannot say that the bytes are still the ones it
wrote. A shard cut short (a copy that stopped, a full disk during a later rsync) makes DCP fail
deep inside a load, and a shard altered in place loads without a word. So after DCP has finished
a step folder, rank 0 hashes every file in it and writes ``integrity.json`` (a temporary file,
fsynced, then renamed: a reader sees the whole record or none). Resume re-hashes and compares
(:func:`verify_checkpoint`).

Hashing reads the checkpoint back once per save and once per candidate at resume: SHA-256 runs at
about 1-2 GB/s per core, and the files are hashed in parallel threads (hashlib releases the GIL),
which is small beside writing them.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

RECORD = "integrity.json"
_VERSION = 1
_CHUNK = 8 << 20


def _files(path: str) -> list[str]:
    """Every file under ``path`` (relative names, sorted), the record and its temporary aside."""
    out = []
    for root, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel not in (RECORD, RECORD + ".tmp"):
                out.append(rel)
    return sorted(out)


def _sha256(file: str) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _digests(path: str, names: list[str]) -> list[str]:
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda n: _sha256(os.path.join(path, n)), names))


def write_integrity_record(path: str) -> dict:
    """Hash every file of the finished checkpoint folder ``path`` and write its record last."""
    names = _files(path)
    record = {
        "version": _VERSION,
        "files": {n: {"bytes": os.path.getsize(os.path.join(path, n)), "sha256": d}
                  for n, d in zip(names, _digests(path, names))},
    }
    tmp = os.path.join(path, RECORD + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, RECORD))
    return record


def has_integrity_record(path: str) -> bool:
    return os.path.isfile(os.path.join(path, RECORD))


def verify_checkpoint(path: str) -> str | None:
    """None when every file of ``path`` has the size and checksum its record says; else why not,
    in a few words naming the file (a missing record is a reason too)."""
    record_path = os.path.join(path, RECORD)
    if not os.path.isfile(record_path):
        return f"no {RECORD} (saved by a version without integrity records, or interrupted before it)"
    try:
        with open(record_path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{RECORD} is unreadable ({type(e).__name__}: {e})"
    present = _files(path)
    missing = sorted(set(files) - set(present))
    if missing:
        return f"{missing[0]} is missing" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
    extra = sorted(set(present) - set(files))
    if extra:
        return f"{extra[0]} is not in its {RECORD}"
    names = sorted(files)
    for name in names:
        size = os.path.getsize(os.path.join(path, name))
        if size != files[name]["bytes"]:
            return f"{name} is {size} bytes, its {RECORD} says {files[name]['bytes']}"
    for name, digest in zip(names, _digests(path, names)):
        if digest != files[name]["sha256"]:
            return f"{name} has other bytes than when it was saved (SHA-256 differs from {RECORD})"
    return None


def newest_verified(steps: list[int], step_folder) -> tuple[int | None, list[str], bool]:
    """The newest of ``steps`` (ascending) to resume from: the newest whose record verifies, or,
    newer than any such, one with no record at all (DCP finished it, nothing can vouch for its
    bytes). Returns ``(step or None, one 'step-N (why)' per checkpoint passed over, verified)``."""
    skipped = []
    for step in reversed(steps):
        path = step_folder(step)
        if not has_integrity_record(path):
            return step, skipped, False
        why = verify_checkpoint(path)
        if why is None:
            return step, skipped, True
        skipped.append(f"{os.path.basename(path)} ({why})")
    return None, skipped, False


def broadcast_choice(choice):
    """Rank 0's choice, on every rank (rank 0 alone reads the files back)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return choice
    box = [choice]
    dist.broadcast_object_list(box, src=0)
    return box[0]
