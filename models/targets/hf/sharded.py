"""A transformers target sharded as it loads: the model is built with its parameters on the meta
device (its buffers, RoPE frequencies and embedding scales, are computed on the host as
transformers computes them, since checkpoints do not store them), sharded with FSDP2, allocated,
and each rank reads only its rows of every tensor from the safetensors files. No rank ever holds
the whole target; the largest transient is one parameter's host allocation while it is built."""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from models.targets.qwen3 import state_dict as st


@contextlib.contextmanager
def params_on_meta():
    """Every parameter registered inside lands on the meta device; buffers stay where built."""
    real = nn.Module.register_parameter

    def register(module, name, param):
        real(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = real


def allocate_keeping_buffers(model: nn.Module, device) -> None:
    """``to_empty`` on ``device`` (the sharded parameters get their local storage), with every
    buffer's computed value put back: ``to_empty`` would leave them uninitialized."""
    buffers = {(id(m), n): b for m in model.modules() for n, b in m._buffers.items() if b is not None}
    model.to_empty(device=device)
    for m in model.modules():
        for n in list(m._buffers):
            if (id(m), n) in buffers:
                m._buffers[n] = buffers[(id(m), n)].to(device)


@torch.no_grad()
def load_sharded_parameters(hf: nn.Module, folder: str) -> None:
    """Copy each parameter of ``hf`` (FSDP2-sharded or not) from ``folder``'s safetensors files,
    reading only this rank's rows. A parameter the checkpoint lacks is a ValueError naming it
    (a tied LM head is the embedding and is read once)."""
    files, weight_map = st._checkpoint_files(folder)
    if weight_map is None:
        with st.safe_open(files[0], framework="pt", device="cpu") as f:
            where = dict.fromkeys(f.keys(), files[0])
    else:
        where = {k: os.path.join(folder, v) for k, v in weight_map.items()}
    params = dict(hf.named_parameters())  # tied tables appear once, under the embedding's name
    missing = [n for n in params if n not in where]
    if missing:
        raise ValueError(f"target.path: {folder} holds no {missing[0]!r} of its {type(hf).__name__} "
                         f"({len(missing)} parameters missing)")
    by_file: dict[str, list[str]] = {}
    for name in params:
        by_file.setdefault(where[name], []).append(name)
    for path, names in by_file.items():
        with st.safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(params[name].shape):
                    raise ValueError(f"target.path: {name!r} in {path} has shape {shape}, "
                                     f"the model expects {tuple(params[name].shape)}")
                st._copy_from_file(params[name], f, name)
