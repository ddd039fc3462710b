"""A trained draft read back for decoding: from an export folder (the serving contract) or a DCP step
folder (with its dump folder's ``model_args.json`` and ``run_info.json``)."""

from __future__ import annotations

import os

from titan_draft.checkpoint.export import PROVENANCE_NAME, load_export, read_provenance
from titan_draft.checkpoint.model_args import MODEL_ARGS_NAME
from titan_draft.components.json_file import read_json_object
from titan_draft.protocols import get_model_spec

RUN_INFO_NAME = "run_info.json"


def _read(reader, path: str) -> dict:
    """``reader(path)``, its one-line error naming the flag it came through."""
    try:
        return reader(path)
    except ValueError as e:
        raise ValueError(f"--draft: {e}") from None


def _export_draft_name(path: str, name: str | None) -> tuple[str, dict]:
    run = _read(read_provenance, path).get("run", {})
    name = name or run.get("draft", "").split("/")[0]
    if not name:
        raise ValueError(f"--draft: {path} has no {PROVENANCE_NAME} naming its draft; pass --draft-name")
    return name, run


def _is_export(path: str) -> bool:
    """True for an export folder, False for a DCP step folder; anything else is refused."""
    if os.path.isfile(os.path.join(path, "config.json")):
        return True
    if os.path.isfile(os.path.join(path, ".metadata")):
        return False
    raise ValueError(f"--draft: {path!r} is neither an export folder (config.json) nor a DCP "
                     "checkpoint folder (.metadata)")


def _dump_file(step_path: str, name: str) -> dict:
    """A JSON file of the dump folder a DCP step folder (``<dump>/checkpoint/step-N``) sits in."""
    return _read(read_json_object, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(step_path))), name))


def draft_spec(path: str, name: str | None):
    """The ModelSpec of an export or DCP step folder, without reading its weights (to check a
    request against the draft before any work)."""
    if _is_export(path):
        return get_model_spec(_export_draft_name(path, name)[0])
    return get_model_spec(name or _dump_file(path, RUN_INFO_NAME)["draft"].split("/")[0])


def load_draft_source(path: str, name: str | None) -> tuple:
    """``(spec, args, state_dict, run_info)`` of an export folder or a DCP step folder."""
    if _is_export(path):
        tensors, config = load_export(path)
        name, run = _export_draft_name(path, name)
        spec = get_model_spec(name)
        if spec.from_export_fn is None:
            raise ValueError(f"draft {name!r} cannot be read back from an export")
        args, state = spec.from_export_fn(tensors, config)
        return spec, args, state, run
    import torch.distributed.checkpoint as dcp

    run = _dump_file(path, RUN_INFO_NAME)
    spec = get_model_spec(name or run["draft"].split("/")[0])
    args = type(next(iter(spec.flavors.values())))(**_dump_file(path, MODEL_ARGS_NAME))
    model = spec.model_cls(args)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=path)
    return spec, args, state["model"], run
