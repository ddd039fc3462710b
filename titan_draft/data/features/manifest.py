"""The feature cache's manifest: what the features were captured from, and the check that a
training job agrees with it before any step runs.

A cache folder holds the shards, one ``index.rank<r>.jsonl`` per prepare rank (one line per
finished shard: the resume record) and, once every rank has finished, ``manifest.json``:

    format, complete, storage, rows, tokens
    facts:  target_path, target_config_hash, family, hidden_size, num_hidden_layers,
            capture_layers, last_hidden, tokenizer_hash, template, template_hash,
            system_prompt_hash, enable_thinking, last_turn_only, max_length, reserved_ids,
            data (source, max_rows, holdout_rows)
    shards: [{file, rank, rows, tokens, bytes, sha256}, ...]

The hashes are of content, not of paths, so a cache moved to another machine (another
``target.path``, another tokenizer folder) is still recognised.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from typing import Any

from titan_draft.components.disk_full import write_atomic
from titan_draft.data.chat.template import render_chat
from titan_draft.data.features.shards import FORMAT, file_sha256
from titan_draft.data.sources.rows import normalize_row

__all__ = ["MANIFEST", "check_cache_files", "check_manifest", "job_facts", "load_manifest", "rank_index_path",
           "read_rank_index", "target_config_hash", "write_json_atomic"]

MANIFEST = "manifest.json"

# A conversation rendered through the job's tokenizer and template: any difference in vocabulary,
# merges, special tokens, template, system prompt or thinking mode changes its tokens or mask.
_PROBE = {"conversations": [
    {"from": "human", "value": "Hello, world! 12345 67 -- naïve café, 東京. \n\tdef f(x): return x**2"},
    {"from": "gpt", "value": "Sure:  f(3) = 9.\n\n```py\nprint(f(3))\n```"},
    {"from": "human", "value": "And f(-1.5)?"},
    {"from": "gpt", "value": "2.25"},
]}


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def target_config_hash(cfg: Any, target_args: Any) -> str:
    """The target's identity: config.json and the weight files' names and sizes for a folder (no
    weight bytes are read), the architecture and seed for a random-weight flavor."""
    path = cfg.target.path
    if not path:
        return _sha({"family": cfg.target.family, "flavor": cfg.target.flavor, "seed": cfg.target.seed,
                     "args": dataclasses.asdict(target_args)})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    weights = sorted((os.path.basename(p), os.path.getsize(p)) for p in glob.glob(os.path.join(path, "*.safetensors")))
    return _sha({"config": config, "weights": weights})


def job_facts(cfg: Any, target_args: Any, tokenizer: Any, chat: Any, layer_ids: list[int], last_hidden: bool,
              reserved_ids: list[int]) -> dict[str, Any]:
    """Everything about a job that changes the captured features or the rows they come from
    (``chat``: the run's resolved ``ChatFormat``)."""
    d = cfg.data
    turns = normalize_row(_PROBE)
    ids, mask = render_chat(turns, tokenizer, chat.template, chat.system_prompt, enable_thinking=chat.enable_thinking,
                            last_turn_only=chat.last_turn_only)
    return {
        "target_path": cfg.target.path or f"random:{cfg.target.flavor}",
        "target_config_hash": target_config_hash(cfg, target_args),
        "hidden_size": target_args.hidden_size,
        "num_hidden_layers": target_args.num_hidden_layers,
        "capture_layers": list(layer_ids),
        "last_hidden": bool(last_hidden),
        "tokenizer_hash": _sha({"n_vocab": tokenizer.n_vocab, "pad_id": tokenizer.pad_id,
                                "probe": tokenizer.encode(_PROBE["conversations"][0]["value"])}),
        "template": chat.template,
        "template_hash": _sha({"ids": ids, "mask": mask}),
        "system_prompt_hash": _sha(chat.system_prompt),
        "enable_thinking": chat.enable_thinking,
        "last_turn_only": chat.last_turn_only,
        "max_length": d.max_length,
        "reserved_ids": sorted(reserved_ids),
        "data": {"source": d.source, "max_rows": d.max_rows, "holdout_rows": d.holdout_rows},
    }


# fact -> (the job field a mismatch names, what it is)
_FIELDS = {
    "target_config_hash": ("target.path", "target (config.json / weight files)"),
    "hidden_size": ("target.path", "target hidden_size"),
    "tokenizer_hash": ("target.tokenizer", "tokenizer"),
    "template": ("data.chat_template", "chat template"),
    "system_prompt_hash": ("data.system_prompt", "system prompt"),
    "enable_thinking": ("data.enable_thinking", "enable_thinking"),
    "last_turn_only": ("data.last_turn_only", "last_turn_only"),
    "template_hash": ("data.chat_template", "rendered chat format"),
    "max_length": ("data.max_length", "max_length"),
}


def check_manifest(manifest: dict[str, Any], facts: dict[str, Any], where: str) -> None:
    """Refuse a cache that does not hold this job's features: one line naming the job field."""
    cached = manifest["facts"]
    for fact, (key, what) in _FIELDS.items():
        if cached.get(fact) != facts[fact]:
            shown = (cached.get(fact), facts[fact]) if "hash" not in fact else ("one", "another")
            raise ValueError(f"{key}: {where} was captured with {what} {shown[0]!r}, this job has {shown[1]!r}")
    missing = [i for i in facts["capture_layers"] if i not in cached["capture_layers"]]
    if missing:
        raise ValueError(f"target.capture_layers: {where} holds capture layers {cached['capture_layers']}, "
                         f"this job's draft reads {facts['capture_layers']} ({missing} not captured)")
    if facts["last_hidden"] and not cached["last_hidden"]:
        raise ValueError(f"model.name: this draft needs the target's final-norm last hidden state, which {where} "
                         "lacks (prepare the cache for this draft)")
    unfiltered = sorted(set(facts["reserved_ids"]) - set(cached["reserved_ids"]))
    if unfiltered:
        raise ValueError(f"model.name: this draft reserves token ids {unfiltered}, but {where}'s rows were not "
                         "filtered for them (prepare the cache for this draft)")


def load_manifest(folder: str) -> dict[str, Any]:
    """``manifest.json`` of a finished cache; a one-line error naming the file otherwise."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isdir(folder):
        raise ValueError(f"data.feature_cache: {folder!r} does not exist or is not a folder")
    if not os.path.isfile(path):
        partial = glob.glob(os.path.join(folder, "index.rank*.jsonl"))
        hint = " (an unfinished prepare: run scripts/prepare_features.py again to complete it)" if partial else ""
        raise ValueError(f"data.feature_cache: {path} is missing{hint}")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"data.feature_cache: {path} is not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"data.feature_cache: {path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    if not manifest.get("complete"):
        raise ValueError(f"data.feature_cache: {path} is not complete (prepare did not finish)")
    return manifest


def check_cache_files(folder: str, shards: list[dict[str, Any]], verify: bool) -> None:
    """Every listed shard exists with its recorded size (a cut-off copy is caught here) and, with
    ``verify``, its recorded sha256 (this reads every byte of the shards)."""
    for s in shards:
        path = os.path.join(folder, s["file"])
        if not os.path.isfile(path):
            raise ValueError(f"data.feature_cache: shard {path} listed in {MANIFEST} is missing")
        size = os.path.getsize(path)
        if size != s["bytes"]:
            raise ValueError(f"data.feature_cache: shard {path} has {size} bytes, {MANIFEST} records "
                             f"{s['bytes']} (truncated or overwritten)")
    if verify:
        for s in shards:
            path = os.path.join(folder, s["file"])
            if file_sha256(path) != s["sha256"]:
                raise ValueError(f"data.feature_cache: shard {path} fails its sha256 checksum (corrupted; "
                                 "delete it and its index line, then run prepare again)")


def rank_index_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"index.rank{rank:03d}.jsonl")


def read_rank_index(folder: str, rank: int) -> list[dict[str, Any]]:
    """The finished shards one prepare rank recorded, in order; a cut-off last line (a kill in
    the middle of the append) is dropped, its shard is rewritten."""
    path = rank_index_path(folder, rank)
    if not os.path.isfile(path):
        return []
    entries = []
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break
            entries.append(json.loads(line))
    return entries


def write_json_atomic(path: str, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1))
