"""A checked tokenizer.json kept on disk, so the next process reads it instead of checking it again.

Reading a 151k-token ``tokenizer.json`` and proving that tiktoken gives HF's ids for it (every
merge against the vocabulary and the id order, every entry in the byte-level alphabet) is about a
second of pure Python, paid by every process that starts: each rank of a job, each eval, each
launch. What it yields depends only on the file's bytes and on the code that checks them, so the
result is stored under a key made of both: an edited file, or a changed check, is a miss and is
checked in full. Only a file that passed is stored.

Where: ``$TITAN_DRAFT_CACHE`` if set (``off`` turns the cache off), else
``$XDG_CACHE_HOME/titan_draft`` or ``~/.cache/titan_draft``; entries go to ``tokenizers/``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import os
import pickle
from typing import Callable

from titan_draft.components.disk_full import write_atomic

logger = logging.getLogger("titan_draft")

CACHE_ENV = "TITAN_DRAFT_CACHE"
_OFF = ("off", "0", "false", "none")


def cache_root() -> str | None:
    """The cache folder, or None when ``$TITAN_DRAFT_CACHE`` turns it off."""
    value = os.environ.get(CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in _OFF or not value.strip() else value
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "titan_draft")


@functools.lru_cache(maxsize=1)
def code_key() -> bytes:
    """A digest of this package's code: the checks that decide what a file yields."""
    folder = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.digest()


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


def cached_tokenizer_json(path: str, read: Callable):
    """``read(path)`` (a ``TokenizerFiles``), or what it gave for a file with the same bytes. A
    ``ValueError`` from ``read`` passes through and nothing is stored."""
    root = cache_root()
    if root is None:
        return read(path)
    with open(path, "rb") as f:
        key = hashlib.sha256(code_key() + f.read()).hexdigest()
    entry = os.path.join(root, "tokenizers", f"{key}.pkl")
    try:
        with open(entry, "rb") as f:
            files = pickle.load(f)
        return dataclasses.replace(files, source=path)
    except FileNotFoundError:
        pass
    except Exception as e:  # a cut-off or foreign file: checked again and written over
        _warn_once(f"tokenizer cache: {entry} is unreadable ({type(e).__name__}); checking {path} again")
    files = read(path)
    try:
        os.makedirs(os.path.dirname(entry), exist_ok=True)
        # whole or absent; ranks of one job writing the same entry at once each rename their own file
        write_atomic(entry, pickle.dumps(files, protocol=pickle.HIGHEST_PROTOCOL))
    except OSError as e:
        _warn_once(f"tokenizer cache: cannot write under {root} ({e}); each process checks the tokenizer "
                   f"again (set {CACHE_ENV} to a writable folder, or to 'off')")
    return files
