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


def load_draft_source(path: str, name: str | None) -> tuple:
    """``(spec, args, state_dict, run_info)`` of an export folder or a DCP step folder."""
    if os.path.isfile(os.path.join(path, "config.json")):
        tensors, config = load_export(path)
        run = _read(read_provenance, path).get("run", {})
        name = name or run.get("draft", "").split("/")[0]
        if not name:
            raise ValueError(f"--draft: {path} has no {PROVENANCE_NAME} naming its draft; pass --draft-name")
        spec = get_model_spec(name)
        if spec.from_export_fn is None:
            raise ValueError(f"draft {name!r} cannot be read back from an export")
        args, state = spec.from_export_fn(tensors, config)
        return spec, args, state, run
    if os.path.isfile(os.path.join(path, ".metadata")):
        import torch.distributed.checkpoint as dcp

        dump = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        run = _read(read_json_object, os.path.join(dump, RUN_INFO_NAME))
        spec = get_model_spec(name or run["draft"].split("/")[0])
        fields = _read(read_json_object, os.path.join(dump, MODEL_ARGS_NAME))
        args = type(next(iter(spec.flavors.values())))(**fields)
        model = spec.model_cls(args)
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        return spec, args, state["model"], run
    raise ValueError(f"--draft: {path!r} is neither an export folder (config.json) nor a DCP "
                     "checkpoint folder (.metadata)")
