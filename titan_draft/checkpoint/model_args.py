"""``model_args.json``: what the draft is, written next to its checkpoints, so that a DCP checkpoint
can be evaluated or exported without its job config."""

from __future__ import annotations

import dataclasses
import json
import os

MODEL_ARGS_NAME = "model_args.json"


def save_model_args(args, folder: str) -> None:
    """What the draft is, next to its checkpoints (so a DCP checkpoint can be evaluated)."""
    with open(os.path.join(folder, MODEL_ARGS_NAME), "w") as f:
        json.dump(dataclasses.asdict(args), f, indent=2)
