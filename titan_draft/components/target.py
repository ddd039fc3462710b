"""The frozen target: built from a local HF folder or as a seeded random-weight model, sharded
with FSDP2, run under no_grad to produce ``TargetFeatures``.

Like drafts, target families live in ``models/<family>`` and are imported by name; a family
module exposes ``TARGET_FLAVORS``, ``TARGET_MODEL_CLS``, ``args_from_hf_config(dict)`` and
``load_hf_state_dict(model, folder)``.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from titan_draft.protocols import TargetFeatures

_HF_MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama3"}


@dataclass
class TargetBundle:
    model: nn.Module
    args: Any
    family: str
    source: str
    """'random:<flavor>' or the checkpoint folder."""

    @property
    def info(self) -> dict:
        """Target facts a draft export needs (config.json fields)."""
        a = self.args
        return {
            "num_hidden_layers": a.num_hidden_layers,
            "vocab_size": a.vocab_size,
            "hidden_size": a.hidden_size,
            "rope_theta": a.rope_theta,
            "max_position_embeddings": a.max_position_embeddings,
            "source": self.source,
        }


def check_target_config(cfg) -> None:
    """Fail before any process group starts when the job cannot get a target."""
    t = cfg.target
    where = f" (job file {cfg.job.config_file})" if cfg.job.config_file else ""
    if t.path:
        if not os.path.isdir(t.path):
            raise ValueError(f"target.path: {t.path!r} does not exist or is not a folder{where}")
        model_type = read_hf_config(t.path)["model_type"]
        if model_type != "qwen3":
            # token ids, the chat format and the mask token come from the Qwen3 tokenizer today
            raise ValueError(
                f"target.path: {t.path} is a {model_type} model; it loads (build_target), but training "
                "needs its own tokenizer and chat format, which only Qwen3 targets have so far"
            )
    elif not t.flavor:
        raise ValueError(
            f"target.path is required by this job{where}: pass --target.path /path/to/hf_checkpoint_folder "
            "(or --target.flavor NAME for a random-weight target, for benchmarks only)"
        )


def read_hf_config(folder: str) -> dict:
    """config.json of an HF checkpoint folder whose model_type a target family supports."""
    cfg_path = os.path.join(folder, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"target.path: {folder!r} has no config.json (expected an HF checkpoint folder)")
    with open(cfg_path) as f:
        hf_config = json.load(f)
    model_type = hf_config.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise ValueError(
            f"target.path: {cfg_path} has model_type {model_type!r}; supported: {sorted(_HF_MODEL_TYPES)}"
        )
    return hf_config


def _family_module(family: str):
    return importlib.import_module(f"models.{family}")


def build_target(cfg, device: torch.device, dtype: torch.dtype) -> TargetBundle:
    """Build the frozen target on ``device`` in ``dtype`` (not yet sharded)."""
    tcfg = cfg.target
    if tcfg.path:
        folder = tcfg.path
        hf_config = read_hf_config(folder)
        model_type = hf_config["model_type"]
        family = _HF_MODEL_TYPES[model_type]
        mod = _family_module(family)
        args = mod.args_from_hf_config(hf_config)
        with torch.device("meta"):
            model = mod.TARGET_MODEL_CLS(args)
        model.to_empty(device=device)
        mod.load_hf_state_dict(model, folder)
        source = folder
    else:
        family = "qwen3"
        mod = _family_module(family)
        if tcfg.flavor not in mod.TARGET_FLAVORS:
            raise ValueError(
                f"target.flavor: {tcfg.flavor!r} is not a {family} flavor "
                f"({sorted(mod.TARGET_FLAVORS)}); set target.path to a checkpoint folder for real training"
            )
        args = mod.TARGET_FLAVORS[tcfg.flavor]
        with torch.device(device):
            model = mod.TARGET_MODEL_CLS(args)
        model.init_weights(seed=tcfg.seed)
        source = f"random:{tcfg.flavor}"
    model.to(dtype)
    model.requires_grad_(False)
    model.eval()
    return TargetBundle(model=model, args=args, family=family, source=source)


@torch.no_grad()
def compute_features(
    target: nn.Module, batch: dict[str, torch.Tensor], layer_ids: list[int], need_last_hidden: bool
) -> TargetFeatures:
    """Run the frozen target on one micro-batch (already on device)."""
    aux, last = target.capture(batch["input_ids"], layer_ids, need_last_hidden)
    return TargetFeatures(
        input_ids=batch["input_ids"],
        loss_mask=batch["loss_mask"],
        valid_lengths=batch["valid_lengths"],
        aux_hidden=aux,
        last_hidden=last,
    )
