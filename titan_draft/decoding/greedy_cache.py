"""Plain greedy decodes kept on disk: ``python -m titan_draft.eval --greedy-cache FILE``.

The target is frozen, so its plain greedy output for a prompt is the same whichever draft is
evaluated against it. A comparison of several drafts (scripts/compare_drafts.py) decodes each
prompt plainly once and checks every later draft against that decode: an eval at T = 0 then costs
its speculative decode alone. Each entry keeps what the eval that made it measured (tokens, top-2
margins, wall clock), so the plain tokens/s of a later eval are the first one's. That is why the
file is used only by an eval on the same machine since its last boot, with the same target
weights, dtype, device and decoding path: another setting is named in one line and decoded anew.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform

import torch

from titan_draft.components.disk_full import write_atomic
from titan_draft.decoding.speculative import Generation

logger = logging.getLogger(__name__)

SCHEMA = "titan_draft.greedy_cache/1"

Key = tuple[tuple[int, ...], int, tuple[int, ...]]
"""(prompt ids, max_new_tokens, sorted stop ids): ``acceptance.evaluate``'s ``greedy_cache`` key."""


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux: the host name alone
        return ""


def cache_setting(target: str, table_fingerprint: str, dtype: str, device: torch.device, cuda_graphs: bool) -> dict:
    """What a cached decode, and the speed it recorded, depend on."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"target": os.path.realpath(target), "table_fingerprint": table_fingerprint, "dtype": dtype,
            "device": f"{device.type}: {name}", "host": platform.node(), "boot": _boot_id(),
            "cuda_graphs": bool(cuda_graphs and device.type == "cuda"), "torch": torch.__version__}


def load_greedy_cache(path: str, setting: dict) -> dict[Key, Generation]:
    """The decodes of ``path`` (empty when it does not exist or was made with another setting,
    logged). Raises ValueError, naming the file, when it is not a greedy cache."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, not {SCHEMA!r}")
        if data["setting"] != setting:
            changed = sorted(k for k in set(data["setting"]) | set(setting) if data["setting"].get(k) != setting.get(k))
            logger.info("greedy cache %s was made with another %s: decoding plain greedy again", path, ", ".join(changed))
            return {}
        return {(tuple(e["ids"]), int(e["max_new_tokens"]), tuple(e["stop_ids"])): Generation(**e["generation"])
                for e in data["entries"]}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--greedy-cache {path}: not a readable greedy cache ({e}); delete it or name another file") from None


def save_greedy_cache(path: str, setting: dict, cache: dict[Key, Generation]) -> None:
    entries = [{"ids": list(ids), "max_new_tokens": n, "stop_ids": list(stops), "generation": dataclasses.asdict(g)}
               for (ids, n, stops), g in cache.items()]
    write_atomic(path, json.dumps({"schema": SCHEMA, "setting": setting, "entries": entries}))
