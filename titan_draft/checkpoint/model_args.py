"""``model_args.json``: what the draft is, written next to its checkpoints, so that a DCP checkpoint
can be evaluated or exported without its job config."""

from __future__ import annotations

import dataclasses
import json
import os

from titan_draft.components.disk_full import write_atomic

MODEL_ARGS_NAME = "model_args.json"


def save_model_args(args, folder: str) -> None:
    """What the draft is, next to its checkpoints (so a DCP checkpoint can be evaluated)."""
    write_atomic(os.path.join(folder, MODEL_ARGS_NAME), json.dumps(dataclasses.asdict(args), indent=2))
