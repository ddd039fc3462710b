"""EAGLE-3's draft vocabulary: the ``draft_vocab_size`` most frequent loss-masked tokens of the
training data, as ``d2t`` (int64 ``[Vd]``: target id = k + d2t[k]) and ``t2d`` (bool ``[V]``:
in the draft vocabulary), the tensors SGLang reads from the export.

Counted once, before training, over one pass of the job's own rendered and tokenized rows (each
DP rank its rows, then summed), and written with what it was counted from. A file whose origin
differs from the job's is refused naming the field: a vocabulary counted on other data, another
tokenizer or template silently changes which tokens the draft can ever propose.
"""

from __future__ import annotations

import itertools
import json
import os
from typing import Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["build_draft_vocab", "count_loss_tokens", "load_draft_vocab", "load_draft_vocab_tensors", "read_draft_vocab",
           "save_draft_vocab", "unseen_coverage"]

_ORIGIN_KEY = "titan_draft.draft_vocab.origin"


def count_loss_tokens(samples: Iterable[tuple[list[int], list[bool]]], vocab_size: int,
                      chunk_tokens: int = 1 << 22, parts: int = 1) -> torch.Tensor:
    """``[V]`` int64 counts of the tokens whose loss mask is True (one bincount per ~4M tokens,
    not one ``[V]`` pass per sample). ``parts`` > 1: ``[parts, V]``, sample ``i`` counted in row
    ``i % parts`` (what :func:`unseen_coverage` reads)."""
    counts = torch.zeros(parts, vocab_size, dtype=torch.int64)
    kept: list[list[int]] = [[] for _ in range(parts)]

    def flush(part: int) -> None:
        if kept[part]:
            counts[part].add_(torch.bincount(torch.tensor(kept[part], dtype=torch.int64), minlength=vocab_size))
            kept[part].clear()

    for i, (ids, mask) in enumerate(samples):
        part = i % parts
        kept[part].extend(itertools.compress(ids, mask))
        if len(kept[part]) >= chunk_tokens:
            flush(part)
    for part in range(parts):
        flush(part)
    return counts[0] if parts == 1 else counts


def unseen_coverage(halves: torch.Tensor, draft_vocab_size: int) -> float:
    """The share of loss tokens a vocabulary covers on text it was not counted from, estimated
    from ``[2, V]`` counts of two halves of the rows: the vocabulary of the first half, measured on
    the second. Coverage of the counted text itself flatters: on SmolLM2's regenerated answers a
    16384-token vocabulary covers 99.0 % of them, 97.4 % of the other half's, and 96.3 % of the
    target's MT-Bench answers (docs/benchmarks/2026-12-05-eagle3-later-turns.md)."""
    total = int(halves[1].sum())
    if total == 0:
        return float("nan")
    _, t2d = build_draft_vocab(halves[0], draft_vocab_size)
    return int(halves[1][t2d].sum()) / total


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` of the ``draft_vocab_size`` most frequent tokens; ties (and tokens never
    seen, which fill a vocabulary larger than the data) go to the lower id, so the result is a
    function of the counts alone."""
    vocab_size = counts.numel()
    if not 0 < draft_vocab_size <= vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1 .. {vocab_size}")
    # stable sort on -count keeps ids ascending among equal counts
    order = torch.sort(-counts.to(torch.int64), stable=True).indices[:draft_vocab_size]
    used = torch.sort(order).values
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def save_draft_vocab(path: str, d2t: torch.Tensor, t2d: torch.Tensor, counts: torch.Tensor, origin: dict) -> None:
    """Write atomically (a temporary name, then a rename): a crash never leaves half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous(), "counts": counts.contiguous()}, path + ".tmp",
              metadata={_ORIGIN_KEY: json.dumps(origin, sort_keys=True)})
    os.replace(path + ".tmp", path)


def load_draft_vocab(path: str, origin: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` of ``path``, refused when it was counted from something else than
    ``origin`` says (the first differing field is named)."""
    try:
        with safe_open(path, "pt") as f:
            saved = json.loads((f.metadata() or {}).get(_ORIGIN_KEY, "{}"))
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model.args.draft_vocab_file: {path} is not a draft vocabulary file: {e}") from None
    for key in sorted(origin):
        if saved.get(key) != origin[key]:
            raise ValueError(
                f"model.args.draft_vocab_file: {path} was counted with {key} = {saved.get(key)!r}, this job "
                f"has {origin[key]!r}; delete it to count again, or point draft_vocab_file elsewhere"
            )
    return d2t, t2d


def read_draft_vocab(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)`` of a file already checked against its job (:func:`load_draft_vocab`)."""
    with safe_open(path, "pt") as f:
        return f.get_tensor("d2t"), f.get_tensor("t2d")


def load_draft_vocab_tensors(args) -> tuple[torch.Tensor, torch.Tensor]:
    """The vocabulary a draft is built with: its ``draft_vocab_file``, else the first
    ``draft_vocab_size`` ids (a stand-in for tests and for a checkpoint that brings its own)."""
    if args.draft_vocab_file:
        d2t, t2d = read_draft_vocab(args.draft_vocab_file)
        if d2t.numel() != args.draft_vocab_size or t2d.numel() != args.vocab_size:
            raise ValueError(f"model.args.draft_vocab_file: {args.draft_vocab_file} holds {d2t.numel()} of "
                             f"{t2d.numel()} tokens, the draft has {args.draft_vocab_size} of {args.vocab_size}")
        return d2t, t2d
    t2d = torch.zeros(args.vocab_size, dtype=torch.bool)
    t2d[: args.draft_vocab_size] = True
    return torch.zeros(args.draft_vocab_size, dtype=torch.int64), t2d
