"""ModelSpec: everything the trainer needs to know about one draft, and its registry.

The engine never imports a draft by name: ``get_model_spec(name)`` imports ``models.<name>``,
whose ``__init__`` calls ``register_model_spec``. Out-of-tree drafts register themselves the same way.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import nn


class DraftModel(Protocol):
    """What a draft module offers the trainer (an ``nn.Module``)."""

    def init_weights(self) -> None:
        """(Re)initialize all trainable parameters; called under no_grad after ``to_empty``."""

    def load_frozen_tables(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's frozen embedding and lm_head (kept out of state_dict)."""

    def set_train_progress(self, step: int, total_steps: int) -> None:
        """Called before each optimizer step's forwards (warm-up ramps of auxiliary losses)."""

    def forward(self, features, *, generator: torch.Generator | None = None):
        """TargetFeatures -> DraftOutput."""


@dataclass
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    """flavor name -> model args dataclass instance."""
    model_cls: type[nn.Module]
    parallelize_fn: Callable[..., nn.Module]
    """(model, parallel_dims, job_config) -> model; float8 -> AC -> compile -> fully_shard."""
    capture_layers_fn: Callable[[Any, int], list[int]]
    """(model_args, num_target_layers) -> capture layer ids (SGLang convention)."""
    export_fn: Callable[[dict[str, torch.Tensor], Any, dict], tuple[dict[str, torch.Tensor], dict]]
    """(full draft state_dict, model_args, target_info) -> (serving tensors, config.json dict)."""
    flops_fn: Callable[[Any, int, int], float] | None = None
    """(model_args, batch_size, seq_len) -> model FLOPs of one training micro-step (fwd + bwd)."""
    needs_last_hidden: bool = False
    """Whether the draft consumes TargetFeatures.last_hidden."""
    build_proposer_fn: Callable[[nn.Module], Any] | None = None
    """(plain eval-mode draft with its frozen tables) -> a ``Proposer`` (protocols/proposer.py):
    how the draft drafts tokens during real speculative decoding (the true-τ eval)."""
    from_export_fn: Callable[[dict[str, torch.Tensor], dict], tuple[Any, dict[str, torch.Tensor]]] | None = None
    """(export tensors, export config.json) -> (model args, state dict): ``export_fn``'s inverse,
    so an exported draft can be evaluated."""
    extra: dict[str, Any] = field(default_factory=dict)


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    if spec.name in _REGISTRY:
        raise ValueError(f"model spec {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        try:
            importlib.import_module(f"models.{name}")
        except ModuleNotFoundError as e:
            if e.name not in (f"models.{name}", "models"):
                raise
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown model.name {name!r}; registered drafts: {sorted(_REGISTRY) or 'none'}"
        )
    return _REGISTRY[name]
