"""ModelSpec: everything the trainer and the eval need to know about one draft, and its registry.

The engine never imports a draft by name: ``get_model_spec(name)`` imports ``models.<name>``,
whose ``__init__`` calls ``register_model_spec`` (a miss imports every package under ``models``
to list what exists). Out-of-tree drafts register themselves the same way.

A fourth draft is one folder ``models/<name>/`` whose ``__init__`` registers a ModelSpec with:
- ``flavors``: named args dataclasses (shape and recipe; block-diffusion drafts extend
  ``models.common.args.BlockDiffusionArgs``);
- ``update_args_fn(args, ArgsContext)``: everything that depends on the target, its tokenizer or
  the job (target width check, capture layers, mask token, static shapes), never touching a
  field the user set under ``[model.args]``;
- ``model_cls(args)``, a ``DraftModel`` (below): ``init_weights``, ``load_frozen_tables`` (the
  target's embedding and lm_head, kept out of every state dict), ``set_train_progress`` and
  ``forward(TargetFeatures, generator=) -> DraftOutput`` (a weighted loss *sum*, its
  denominator and metric sums; the trainer normalizes globally);
- ``capture_layers_fn(args)``: the target layer ids the draft reads, and ``needs_last_hidden``
  (or ``needs_last_hidden_fn(args)`` where a setting decides);
- ``parallelize_fn``: names the blocks and other trainable groups for
  ``distributed.parallelize.parallelize_blocks``; ``float8_skip`` the Linears kept out of float8
  (the trainer converts before ``parallelize_fn``);
- ``export_fn`` / ``from_export_fn``: the serving contract (safetensors + config.json) both ways;
- ``build_proposer_fn(plain draft) -> Proposer`` (protocols/proposer.py): how it drafts during
  real speculative decoding, which the true-acceptance eval measures;
- optionally ``prepare_fn`` (a pass over the training data before the model exists),
  ``flops_fn`` (MFU) and ``reserved_tokens_fn`` (token ids the data must not hold).
Parameter FQNs are the serving names: checkpoints and exports never see wrapper prefixes.

What a draft imports of the engine (and nothing else of ``titan_draft``; never
``titan_draft.data``: what it needs of the data, the tokenizer and the chat format reaches it
through ``ArgsContext`` and ``PrepareContext``):
- ``titan_draft.protocols``: this module, ``TargetFeatures`` / ``DraftOutput``, ``Proposer``;
- ``titan_draft.distributed.parallelize.parallelize_blocks``: what its ``parallelize_fn`` calls;
- ``titan_draft.distributed.cuda_graphs`` (``capture_graph``, ``round_slots``,
  ``maybe_graphs``): to replay its proposal as a CUDA graph.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import nn

from titan_draft.protocols.discovery import import_model_packages


class DraftModel(Protocol):
    """What a draft module offers the trainer (an ``nn.Module``)."""

    def init_weights(self) -> None:
        """(Re)initialize all trainable parameters; called under no_grad after ``to_empty``."""

    def load_frozen_tables(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's frozen embedding and lm_head (kept out of state_dict)."""

    def set_train_progress(self, step: int, total_steps: int) -> None:
        """Called before each optimizer step's forwards (warm-up ramps of auxiliary losses; a
        draft without any implements it as a no-op)."""

    def forward(self, features, *, generator: torch.Generator | None = None):
        """TargetFeatures -> DraftOutput."""


@dataclass
class ArgsContext:
    """What the engine knows when a draft resolves its args (torchtitan's ``update_from_config``)."""

    target: Any
    """The target's architecture args: ``num_hidden_layers``, ``hidden_size``, ``vocab_size``,
    ``intermediate_size``, heads, ``head_dim``, ``rms_norm_eps``, ``rope_theta``,
    ``max_position_embeddings``, ``tie_word_embeddings``."""
    tokenizer: Any
    """The target's ``Tokenizer`` (e.g. to choose a token the data never contains)."""
    chat: Any
    """The run's resolved chat format (``titan_draft.data.chat.format.ChatFormat``): ``template``
    ('chatml', 'qwen3', 'llama3'), ``system_prompt``, ``enable_thinking``, ``last_turn_only`` and
    the ``special_tokens`` the format writes."""
    job: Any
    """The whole ``JobConfig`` (``target.capture_layers``, ``training.static_shapes``, ...)."""
    overrides: frozenset[str]
    """Arg names the user set under ``[model.args]``: a hook keeps those values as given."""


@dataclass
class PrepareContext:
    """What a draft's ``prepare_fn`` may use before its model is built (e.g. to count the
    training data's tokens into a draft vocabulary)."""

    job: Any
    tokenizer: Any
    chat: Any
    """The run's resolved chat format (as ``ArgsContext.chat``)."""
    dump_folder: str
    dp_rank: int
    dp_world: int
    samples: Callable[[], Any]
    """() -> this DP rank's ``(input_ids, loss_mask)`` samples, every usable row once, rendered
    and truncated exactly as training renders them."""
    all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]
    """Sum a CPU tensor over the DP ranks (the identity on one rank)."""
    barrier: Callable[[], None]
    """Wait for every DP rank (e.g. after rank 0 wrote a file the others read)."""

    @property
    def is_rank0(self) -> bool:
        return self.dp_rank == 0


@dataclass
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    """flavor name -> model args dataclass instance."""
    model_cls: type[nn.Module]
    parallelize_fn: Callable[..., nn.Module]
    """(model, parallel_dims, job_config, *, dp_mesh) -> model: names the draft's blocks and
    other trainable groups for ``titan_draft.distributed.parallelize.parallelize_blocks`` (AC ->
    in-place compile -> fully_shard). The trainer has converted float8 before it."""
    update_args_fn: Callable[[Any, ArgsContext], Any]
    """(flavor args with [model.args] applied, context) -> the args the draft is built with:
    everything that depends on the target, its tokenizer or the job is resolved here."""
    capture_layers_fn: Callable[[Any], list[int]]
    """(resolved model_args) -> the target layer ids whose outputs the draft reads (SGLang
    convention), in the order it concatenates them."""
    export_fn: Callable[[dict[str, torch.Tensor], Any, dict], tuple[dict[str, torch.Tensor], dict]]
    """(full draft state_dict, model_args, target_info) -> (serving tensors, config.json dict)."""
    flops_fn: Callable[[Any, int, int], float] | None = None
    """(model_args, batch_size, seq_len) -> model FLOPs of one training micro-step (fwd + bwd)."""
    needs_last_hidden: bool = False
    """Whether the draft consumes TargetFeatures.last_hidden."""
    needs_last_hidden_fn: Callable[[Any], bool] | None = None
    """(model args) -> whether it does, where a setting decides (DFlash2's ``soft_labels``);
    None: ``needs_last_hidden``. Read through :meth:`needs_last_hidden_for`."""
    prepare_fn: Callable[[Any, PrepareContext], Any] | None = None
    """(resolved args, context) -> args: work on the training data before the model is built
    (EAGLE-3 counts its draft vocabulary here); runs on every DP rank."""
    float8_skip: tuple[str, ...] = ()
    """Module FQNs (with everything under them) whose Linears stay in high precision when
    float8 is on."""
    reserved_tokens_fn: Callable[[Any], list[int]] | None = None
    """(resolved model_args) -> token ids the training data must never contain (e.g. a mask
    token chosen among real tokens): rows holding one are skipped and counted."""
    build_proposer_fn: Callable[[nn.Module], Any] | None = None
    """(plain eval-mode draft with its frozen tables) -> a ``Proposer`` (protocols/proposer.py):
    how the draft drafts tokens during real speculative decoding (the true-τ eval)."""
    from_export_fn: Callable[[dict[str, torch.Tensor], dict], tuple[Any, dict[str, torch.Tensor]]] | None = None
    """(export tensors, export config.json) -> (model args, state dict): ``export_fn``'s inverse,
    so an exported draft can be evaluated."""
    extra: dict[str, Any] = field(default_factory=dict)

    def needs_last_hidden_for(self, args: Any) -> bool:
        """Whether a draft with these args (flavor and [model.args] applied) reads the target's
        final-norm hidden states."""
        return self.needs_last_hidden_fn(args) if self.needs_last_hidden_fn is not None else self.needs_last_hidden


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
        import_model_packages()  # so the message lists every draft there is
        raise ValueError(
            f"unknown model.name {name!r}; registered drafts: {sorted(_REGISTRY) or 'none'}"
        )
    return _REGISTRY[name]
