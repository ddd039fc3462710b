"""Export of a trained draft in its serving contract: safetensors + config.json.

The draft's spec owns the mapping to serving names (``export_fn``); this module owns the
mechanics shared by every draft: gathering the full (unsharded) state dict, refusing leaked
wrapper prefixes, casting, and writing the files so that a half-written export never looks whole.

Files written to ``out_dir``:
- ``model.safetensors``: the serving tensors, floating ones cast to ``dtype``, all contiguous.
- ``config.json``: the serving config returned by ``export_fn``.
- ``titan_draft_export.json``: provenance (dtype, tensor/param counts, torch version, plus
  whatever the trainer passes in ``extra_config``: step, capture layers, target, ...), and under
  ``target`` the target it was trained for (architecture facts and a fingerprint of its frozen
  tables), which the eval checks its target against. titan_draft's own facts live here rather
  than in config.json, which belongs to the serving contract.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from titan_draft.components.disk_full import DiskFullError, disk_full_line, free_bytes, is_disk_full
from titan_draft.components.json_file import read_json_object

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
PROVENANCE_NAME = "titan_draft_export.json"

# Prefixes that torch.compile, activation checkpointing and FSDP1 wrappers insert into FQNs; a
# serving engine would not find weights under such names.
_FORBIDDEN_NAME_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp")

ExportFn = Callable[[dict[str, torch.Tensor], Any, dict], tuple[dict[str, torch.Tensor], dict]]
"""(full draft state dict, model_args, target_info) -> (serving tensors, config.json dict)."""


def _default_is_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def _check_names(names, where: str) -> None:
    bad = sorted(n for n in names if any(part in n for part in _FORBIDDEN_NAME_PARTS))
    if bad:
        shown = ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
        raise ValueError(
            f"export: {where} contains wrapper-prefixed names ({shown}); compile/AC/FSDP wrappers "
            f"leaked into the FQNs (apply compile in place, AC inside compile)"
        )


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    else:
        resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ValueError(f"export dtype must be a floating torch dtype name, got {dtype!r}")
    return resolved


def _prepare_tensors(
    tensors: dict[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Cast floating tensors to ``dtype`` (others keep theirs), make them contiguous CPU tensors
    that share no storage (safetensors refuses shared storage, e.g. tied weights)."""
    out: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"export: value of {name!r} is a {type(t).__name__}, not a tensor")
        t = t.detach().cpu()
        if t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage and t.numel() > 0:
            t = t.clone()
        seen_storage.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def export_draft(
    model: nn.Module,
    export_fn: ExportFn,
    model_args: Any,
    target_info: dict,
    out_dir: str,
    *,
    dtype: str | torch.dtype = "bfloat16",
    extra_config: dict | None = None,
    is_rank0: bool | None = None,
    target_record: dict | None = None,
) -> str | None:
    """Write the draft's serving files to ``out_dir``; returns ``out_dir`` on rank 0, else None.

    Collective: every rank must call it (gathering the full state dict all-gathers FSDP2 shards);
    only rank 0 receives the tensors and writes. ``is_rank0`` defaults to the process-group rank
    (True without a process group). ``target_record`` (:func:`build_target_record`) is kept in
    the provenance file under ``target``, for the eval to check its target against.

    Raises:
        DiskFullError: the disk filled up; the line says how much was free and needed, and no
            half-written file is left behind.
    """
    if is_rank0 is None:
        is_rank0 = _default_is_rank0()
    torch_dtype = _resolve_dtype(dtype)
    # With full_state_dict + cpu_offload, ranks other than 0 get an empty dict, so the full model
    # is materialized in CPU memory once, not on every GPU.
    state_dict = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if not is_rank0:
        return None
    _check_names(state_dict.keys(), "the draft state dict")
    # cast first, so export_fn's config (torch_dtype) describes the tensors actually written
    tensors, config = export_fn(_prepare_tensors(state_dict, torch_dtype), model_args, target_info)
    _check_names(tensors.keys(), "export_fn's tensors")
    tensors = _prepare_tensors(tensors, torch_dtype)

    provenance = dict(extra_config or {})
    if target_record is not None:
        provenance["target"] = target_record
    try:
        _write_files(out_dir, tensors, config, provenance, torch_dtype)
    except Exception as e:
        if not is_disk_full(e):
            raise
        needed = sum(t.numel() * t.element_size() for t in tensors.values())
        line = disk_full_line(out_dir, needed=needed, free=free_bytes(out_dir))  # before the cleanup
        for name in (WEIGHTS_NAME, CONFIG_NAME, PROVENANCE_NAME):
            try:
                os.remove(os.path.join(out_dir, name + ".tmp"))
            except OSError:
                pass
        raise DiskFullError(f"export: writing {out_dir} failed: {line}; what was saved before (checkpoints, an "
                            "earlier export) is kept: free space and run the job again to export") from e
    logger.info(
        "export: wrote %d tensors (%d params, %s) to %s",
        len(tensors),
        provenance["num_params"],
        provenance["export_dtype"],
        out_dir,
    )
    return out_dir


def _write_files(out_dir: str, tensors: dict, config: dict, provenance: dict, torch_dtype: torch.dtype) -> None:
    """Every file under a temporary name first, then the renames (which need no space): a full
    disk or a kill never leaves new weights next to an old export's config."""
    os.makedirs(out_dir, exist_ok=True)
    provenance.update(
        {
            "export_dtype": str(torch_dtype).removeprefix("torch."),
            "num_tensors": len(tensors),
            "num_params": sum(t.numel() for t in tensors.values()),
            "tensor_names": sorted(tensors),
            "torch_version": torch.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
    )
    weights_path = os.path.join(out_dir, WEIGHTS_NAME)
    save_file(tensors, weights_path + ".tmp", metadata={"format": "pt"})
    _write_json_tmp(os.path.join(out_dir, CONFIG_NAME), config)
    _write_json_tmp(os.path.join(out_dir, PROVENANCE_NAME), provenance)
    for name in (WEIGHTS_NAME, CONFIG_NAME, PROVENANCE_NAME):
        os.replace(os.path.join(out_dir, name + ".tmp"), os.path.join(out_dir, name))


def _write_json_tmp(path: str, obj: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")


FINGERPRINT_ROWS = 5  # rows of each frozen table hashed, spread over the vocabulary


def table_fingerprint(embed: torch.Tensor, lm_head: torch.Tensor) -> str:
    """A hash of a few rows of the frozen tables, rounded to bfloat16 so that a target loaded in
    float32 for the eval gives the same hash as the bfloat16 copy it was trained with."""
    vocab = embed.shape[0]
    rows = sorted({round(i * (vocab - 1) / (FINGERPRINT_ROWS - 1)) for i in range(FINGERPRINT_ROWS)})
    digest = hashlib.sha256()
    for table in (embed, lm_head):
        picked = table.detach()[rows].to(device="cpu", dtype=torch.float32).to(torch.bfloat16)
        digest.update(picked.contiguous().view(torch.int16).numpy().tobytes())
    return digest.hexdigest()[:16]


TARGET_FACTS = ("family", "num_hidden_layers", "hidden_size", "vocab_size", "rope_theta")


def build_target_record(model: nn.Module, args: Any, family: str) -> dict:
    """What the export records of the target it was trained for: architecture facts and
    :func:`table_fingerprint`. Collective when the tables are sharded (every rank calls it)."""
    record = {"family": family}
    for key in TARGET_FACTS[1:]:
        record[key] = getattr(args, key, None)
    record["table_fingerprint"] = table_fingerprint(model.embed_weight(), model.lm_head_weight())
    return record


def target_mismatches(recorded: dict, actual: dict) -> list[str]:
    """``key recorded X, target has Y`` for every fact of ``recorded`` that ``actual`` differs in."""
    out = []
    for key in (*TARGET_FACTS, "table_fingerprint"):
        if key in recorded and recorded[key] != actual.get(key):
            what = "frozen tables (embedding / lm_head rows)" if key == "table_fingerprint" else key
            out.append(f"{what}: export {recorded[key]}, target {actual.get(key)}")
    return out


def read_provenance(folder: str) -> dict:
    """The provenance an export folder keeps (its step, run info and target record), ``{}`` where
    it keeps none (a DCP step folder, another tool's export). One that is there but unreadable is
    a ``ValueError`` naming the file: what it records is checked against, never guessed."""
    path = os.path.join(folder, PROVENANCE_NAME)
    return read_json_object(path) if os.path.isfile(path) else {}


def exported_step(folder: str) -> int | None:
    """The training step an export folder holds, None where it holds none or its provenance cannot
    be read (the caller exports again: a half-written export is never taken for a finished one)."""
    try:
        return read_provenance(folder).get("step")
    except ValueError:
        return None


def recorded_target(folder: str) -> dict | None:
    """The target record (:func:`build_target_record`) an export folder keeps, None when it
    keeps none (a DCP step folder, an export written before the record existed, another tool's)."""
    record = read_provenance(folder).get("target")
    return record if isinstance(record, dict) else None


def load_export(folder: str) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an export back: (tensors from model.safetensors, config.json as a dict)."""
    weights_path = os.path.join(folder, WEIGHTS_NAME)
    config_path = os.path.join(folder, CONFIG_NAME)
    for path in (weights_path, config_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"export folder {folder} has no {os.path.basename(path)}")
    tensors = load_file(weights_path)
    with open(config_path) as f:
        config = json.load(f)
    return tensors, config
