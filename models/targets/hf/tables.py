"""The frozen tables (input embedding, LM head) of a folder read alone, for offline training:
their parameter names come from the family's own transformers class, built on the meta device,
and only those tensors are read from the safetensors files."""

from __future__ import annotations

import json
import os

import torch
from torch import nn


def _tensor_names(folder: str) -> dict[str, str]:
    """Checkpoint key -> the safetensors file that holds it."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(folder, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"target.path: {folder} has neither model.safetensors nor model.safetensors.index.json")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def load_hf_tables(folder: str, args) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embedding, lm_head)`` ``[V, H]`` of ``folder`` (the same tensor twice when tied)."""
    from safetensors import safe_open

    from models.targets.hf.model import import_transformers
    from models.targets.hf.serving import check_serving_conventions

    transformers = import_transformers()
    with open(os.path.join(folder, "config.json")) as f:
        check_serving_conventions(json.load(f))
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    names: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    files = _tensor_names(folder)
    # a tied table has two names; the checkpoint stores it under one of them
    embed_name = next((n for n in names[id(model.get_input_embeddings().weight)] if n in files), None)
    head: nn.Module = model.get_output_embeddings()
    head_names = [n for n in names[id(head.weight)] if n in files]
    if embed_name is None:
        raise ValueError(f"target.path: {folder} holds no input embedding of its {args.model_type} model")

    def read(name: str) -> torch.Tensor:
        with safe_open(files[name], "pt") as f:
            return f.get_tensor(name)

    embed = read(embed_name)
    tied = head.weight is model.get_input_embeddings().weight or config.get_text_config().tie_word_embeddings
    if tied:
        return embed, embed
    if not head_names:
        raise ValueError(f"target.path: {folder} holds no LM head of its untied {args.model_type} model")
    return embed, read(head_names[0])
