"""TargetSpec: what the engine needs to know about a frozen target family, and its registry.

Targets register like drafts: ``models/<family>/__init__.py`` calls ``register_target_spec``
with the HF ``model_type`` values it loads. The engine never imports a family by name: a
lookup that finds nothing imports every package under ``models`` once (so an out-of-tree family
registers by being importable there), then answers or names what is supported.

A target model (``model_cls(args)``, built on the meta device) offers:
- ``capture(input_ids, layer_ids, need_last_hidden, document_ids=None) -> (aux [B, S, K*H],
  last_hidden | None)``: capture id ``i`` is the output of decoder layer ``i`` (HF
  ``hidden_states[i + 1]``); with ``document_ids`` (packed rows, ``TargetFeatures.document_ids``)
  each document is captured as if it were alone: positions restart, attention stays inside it;
- ``compile_capture(backend)``: compile what ``capture`` runs (``compile.target``), leaving
  decoding with a cache as it is;
- ``model(input_ids) -> logits`` and, for decoding, ``new_cache(batch, max_len, pad=None)``
  and ``model(ids, layer_ids, need_last_hidden, cache=..., logits='all'|'last'|'none')`` ->
  a ``DecodeStep`` (fp32 logits, capture outputs of the new tokens);
- ``embed_weight()`` / ``lm_head_weight()``: the full ``[V, H]`` tables (all-gathered if sharded);
- ``layers`` (an ``nn.ModuleDict`` of its blocks, what FSDP shards), ``tie_weights()``,
  ``init_weights(seed)`` for random-weight flavors, and ``args`` (``num_hidden_layers``,
  ``hidden_size``, ``vocab_size``, ``rope_theta``, ``max_position_embeddings``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from torch import nn

from titan_draft.protocols.discovery import import_model_packages


@dataclass
class TargetSpec:
    family: str
    """Registered name (``qwen3``, ``llama3``); ``target.family`` picks it for random weights."""
    model_types: tuple[str, ...]
    """HF ``config.json`` ``model_type`` values this family loads."""
    model_cls: type[nn.Module]
    args_from_hf_config: Callable[[dict], Any]
    """(config.json dict) -> architecture args; refuses what the model does not implement."""
    load_hf_state_dict: Callable[[nn.Module, str], None]
    """(model with allocated, possibly sharded, parameters; folder) -> None: reads each rank's
    rows straight from the safetensors files, checking every key and shape first."""
    load_tables: Callable[[str, Any], tuple[Any, Any]] | None = None
    """(folder, args) -> (embedding, lm_head) ``[V, H]`` read alone, without the decoder: what
    offline training (features from disk) needs of the target."""
    save_hf_checkpoint: Callable[..., None] | None = None
    """(model, folder, *, dtype, max_shard_bytes) -> None: writes the HF weights (random targets)."""
    flavors: dict[str, Any] = field(default_factory=dict)
    """Random-weight architectures (``target.flavor``), for tests and benchmarks."""
    load_folder: Callable[..., nn.Module] | None = None
    """(folder, *, dtype, device, mesh) -> frozen, sharded, loaded model, for a backend that
    builds the model from the folder itself (the transformers backend) instead of
    ``model_cls(args)`` + ``load_hf_state_dict``."""
    config_features: tuple[str, ...] = ()
    """The optional ``config.json`` features this family implements (``attention_bias``,
    ``mlp_bias``, ``use_sliding_window``): a folder that turns on any other one is refused
    when it is read, since the model would load and then compute something else."""
    check_job: Callable[..., None] | None = None
    """(config.json dict, *, needs_teacher) -> None: ValueError in one line when a draft trained on
    this folder would see at serving other embeddings or teacher logits than in training
    (``needs_teacher``: the draft distils ``last_hidden @ lm_head.T``). Run at start-up."""


@dataclass
class TargetBundle:
    """The job's frozen target and the facts about it the engine passes around."""

    model: nn.Module
    args: Any
    family: str
    source: str
    """The checkpoint folder, 'random:<flavor>' or 'synthetic:<flavor>'."""
    compiled: bool = False
    """Its capture path runs compiled (``compile.target``)."""

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


def random_target_args(family: str, flavor: str, key: str = "target.flavor"):
    """Architecture of random-weight flavor ``flavor`` of target family ``family``; a
    ValueError naming ``key`` for an unknown one."""
    flavors = get_target_spec(family).flavors
    if flavor not in flavors:
        raise ValueError(
            f"{key}: {flavor!r} is not a {family} target flavor ({sorted(flavors)}); set target.path "
            "to a checkpoint folder for real training"
        )
    return flavors[flavor]


def check_capture_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    """Refuse capture ids that are empty or not decoder layers ``0 .. num_layers - 1`` (every
    target's ``capture``, loaded, random-weight or synthetic, takes the same ids)."""
    if not layer_ids:
        raise ValueError("capture: layer_ids is empty")
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"capture layer ids {bad} out of range for a {num_layers}-layer target")


_REGISTRY: dict[str, TargetSpec] = {}


def register_target_spec(spec: TargetSpec) -> None:
    if spec.family in _REGISTRY:
        raise ValueError(f"target family {spec.family!r} is already registered")
    taken = {t: s.family for s in _REGISTRY.values() for t in s.model_types}
    clash = sorted(set(spec.model_types) & set(taken))
    if clash:
        raise ValueError(f"target family {spec.family!r}: model_type(s) {clash} belong to {taken[clash[0]]!r}")
    _REGISTRY[spec.family] = spec


def get_target_spec(family: str) -> TargetSpec:
    if family not in _REGISTRY:
        import_model_packages()
    if family not in _REGISTRY:
        raise ValueError(f"target.family: {family!r} is not a registered target family ({sorted(_REGISTRY)})")
    return _REGISTRY[family]


def target_spec_for_model_type(model_type: str | None, where: str) -> TargetSpec:
    """The family that loads HF ``model_type``; a ValueError naming ``where`` otherwise."""
    import_model_packages()
    for spec in _REGISTRY.values():
        if model_type in spec.model_types:
            return spec
    supported = sorted(t for s in _REGISTRY.values() for t in s.model_types)
    raise ValueError(f"target.path: {where} has model_type {model_type!r}; supported: {supported}")
