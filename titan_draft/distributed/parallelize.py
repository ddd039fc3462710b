"""Module transforms in torchtitan's order: float8 conversion (components/float8.py, by the
trainer) -> ``apply_ac`` -> ``apply_compile`` -> ``apply_fsdp``. A draft's ``parallelize_fn``
names its blocks and other trainable groups and calls :func:`parallelize_blocks`.

All of them work in place on an ``nn.ModuleDict`` of blocks, so parameter FQNs stay those of the
plain model: checkpoints and exports never see ``_orig_mod.`` (in-place ``Module.compile``) and
DCP's state-dict helpers strip ``_checkpoint_wrapped_module.``.
"""

from __future__ import annotations

import logging
from typing import Sequence, Union

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

logger = logging.getLogger(__name__)

_RESHARD_POLICIES = ("default", "always", "never")


def to_dtype(name: str | torch.dtype) -> torch.dtype:
    """'bfloat16' / 'float32' / 'float16' (or a torch.dtype) -> torch.dtype."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"unsupported dtype {name!r} (bfloat16, float16 or float32)")
    return dtype


Blocks = Union[nn.ModuleDict, tuple[nn.Module, Sequence[str]]]
"""A model's repeated blocks: an ``nn.ModuleDict`` of them (``layers``), or ``(parent, names)``
for blocks that are plain attributes (EAGLE3's single ``midlayer``), so FQNs stay the serving
names either way."""


def _block_slots(blocks: Blocks) -> list[tuple[nn.Module, str]]:
    """``(parent, name)`` of every block."""
    if isinstance(blocks, nn.ModuleDict):
        return [(blocks, name) for name in blocks.keys()]
    parent, names = blocks
    return [(parent, name) for name in names]


def block_modules(blocks: Blocks) -> list[nn.Module]:
    return [getattr(parent, name) for parent, name in _block_slots(blocks)]


def apply_ac(blocks: Blocks, mode: str) -> None:
    """Activation checkpointing: with mode 'full' every block recomputes its forward in backward."""
    if mode == "none":
        return
    if mode != "full":
        raise ValueError(f"activation_checkpoint.mode = {mode!r} must be none or full")
    slots = _block_slots(blocks)
    for parent, name in slots:
        # non-reentrant checkpointing composes with FSDP2 hooks and torch.compile; RNG state is
        # preserved so a block that draws random numbers recomputes exactly what it computed
        parent.register_module(name, checkpoint_wrapper(getattr(parent, name), preserve_rng_state=True))
    logger.info("activation checkpointing: full, %d blocks", len(slots))


def apply_compile(blocks: Blocks, fullgraph: bool = False, backend: str = "inductor") -> None:
    """Compile each block in place. ``Module.compile`` keeps the module object (and with it the
    FSDP unit boundary and parameter FQNs); ``torch.compile(block)`` would add ``_orig_mod.``.
    FSDP2's hooks stay outside the graph (dynamo skips them) and run eagerly around each block."""
    modules = block_modules(blocks)
    for block in modules:
        block.compile(fullgraph=fullgraph, backend=backend)
    logger.info("compiled %d blocks in place (backend=%s, fullgraph=%s)", len(modules), backend, fullgraph)


def _reshard_value(policy: str) -> bool | None:
    if policy not in _RESHARD_POLICIES:
        raise ValueError(f"parallelism.fsdp_reshard_after_forward = {policy!r} must be one of "
                         f"{', '.join(_RESHARD_POLICIES)}")
    # 'default' frees the unsharded params after forward: there is no pipeline parallelism that
    # would re-gather them for every micro-batch
    return {"default": True, "always": True, "never": False}[policy]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    blocks: Blocks,
    extra_groups: Sequence[Sequence[nn.Module]] = (),
    param_dtype: str | torch.dtype = "bfloat16",
    reduce_dtype: str | torch.dtype = "float32",
    reshard_after_forward: str = "default",
    gradient_divide_factor: float | None = None,
    shard_blocks: bool = True,
) -> nn.Module:
    """FSDP2 in torchtitan's order: each block, then each extra group (e.g. [norm, head]) as one
    unit, then the root (which takes every parameter left over).

    ``shard_blocks=False``: the blocks get no unit of their own and join the root, which is
    gathered once a step. For a draft whose forward calls its blocks several times a step
    (EAGLE-3's training-time test calls its one layer 7 times): as a unit of its own, a block is
    gathered again by each call and by each call's backward, 14 times a step for 7 calls.

    ``gradient_divide_factor``: None keeps FSDP's mean over the DP ranks. 1.0 sums instead
    (torchtitan's choice), right when each rank's loss is already divided by the *global*
    denominator (all-reduced over DP and accumulation) before backward.
    """
    mp = MixedPrecisionPolicy(param_dtype=to_dtype(param_dtype), reduce_dtype=to_dtype(reduce_dtype))
    reshard = _reshard_value(reshard_after_forward)
    modules = block_modules(blocks) if shard_blocks else []
    for block in modules:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    for group in extra_groups:
        # FSDP prefetches the small tail groups for backward right away, so freeing them after
        # forward only adds an all-gather; do it only when asked to always reshard
        fully_shard(list(group), mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward == "always")
    root_kwargs = {} if reshard_after_forward == "default" else {"reshard_after_forward": reshard}
    # 'default' leaves the root to FSDP's heuristic: it stays unsharded after forward, since
    # backward would all-gather it again at once
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, **root_kwargs)
    _set_gradient_reduction(model, dp_mesh, gradient_divide_factor)
    logger.info("FSDP2: %d blocks + %d extra groups + root over %d ranks (param %s, reduce %s, "
                "reshard_after_forward=%s, gradient_divide_factor=%s)", len(modules), len(extra_groups),
                dp_mesh.size(), mp.param_dtype, mp.reduce_dtype, reshard_after_forward,
                gradient_divide_factor)
    return model


def _set_gradient_reduction(model: nn.Module, dp_mesh: DeviceMesh, factor: float | None) -> None:
    # Gloo has no PREMUL_SUM/AVG reduce-scatter: there, reduce with plain SUM and scale separately
    force_sum = dp_mesh.device_type == "cpu"
    for module in model.modules():
        # these setters only reach the module's own parameter group, so visit every FSDP unit
        if not isinstance(module, FSDPModule):
            continue
        if factor is not None:
            module.set_gradient_divide_factor(factor)
        if force_sum:
            module.set_force_sum_reduction_for_comms(True)


def apply_fsdp_frozen(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    blocks: nn.ModuleDict,
    param_dtype: str | torch.dtype = "bfloat16",
    *,
    extra_groups: Sequence[Sequence[nn.Module]] = (),
) -> nn.Module:
    """FSDP2 for a frozen model that only runs forward (the target): shard each block, each extra
    group (e.g. the embedding), then the root; everything is freed again right after its forward.
    """
    for p in model.parameters():
        if p.requires_grad:
            raise ValueError("apply_fsdp_frozen: the model has trainable parameters; freeze it "
                             "(requires_grad_(False)) first")
    mp = MixedPrecisionPolicy(param_dtype=to_dtype(param_dtype))
    for block in blocks.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    for group in extra_groups:
        fully_shard(list(group), mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=True)
    # FSDP keeps the root's params unsharded after forward on the assumption that backward follows;
    # a frozen model has no backward, so free them (a no-op where torch already honoured True)
    model.register_forward_hook(_reshard_root_hook)
    logger.info("FSDP2 (frozen): %d blocks + %d extra groups + root over %d ranks (param %s)",
                len(blocks), len(extra_groups), dp_mesh.size(), mp.param_dtype)
    return model


def _reshard_root_hook(module: nn.Module, args, output):
    module.reshard()
    return output


def parallelize_blocks(model: nn.Module, job_config, dp_mesh: DeviceMesh | None, *, blocks: Blocks,
                       groups: Sequence[Sequence[nn.Module]] = (), shard_blocks: bool = True) -> nn.Module:
    """The shared body of every draft's ``parallelize_fn``: activation checkpointing (if on) ->
    in-place compile of each block -> ``fully_shard`` per block, then each group, then the root,
    with ``MixedPrecisionPolicy(param, reduce)`` from the job. ``groups`` are the trainable
    modules outside the blocks that share an FSDP unit (e.g. ``[fc, hidden_norm]``);
    ``shard_blocks=False`` leaves the blocks to the root unit (:func:`apply_fsdp`)."""
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(blocks, job_config.activation_checkpoint.mode)
    if job_config.compile.enable:
        apply_compile(blocks, fullgraph=job_config.compile.fullgraph, backend=job_config.compile.backend)
    if dp_mesh is not None:
        param_dtype, reduce_dtype = mixed_precision_dtypes(job_config, dp_mesh.device_type)
        apply_fsdp(model, dp_mesh, blocks=blocks, extra_groups=groups, param_dtype=param_dtype,
                   reduce_dtype=reduce_dtype, reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
                   shard_blocks=shard_blocks)
    return model


def mixed_precision_dtypes(job_config, device_type: str) -> tuple[str, str]:
    """(param, reduce) dtype names for the draft's FSDP2 policy: the configured ones on GPU, float32
    on CPU, where the debug job and the tests run (bf16 matmuls there are slow and inexact)."""
    if device_type != "cuda":
        return "float32", "float32"
    t = job_config.training
    return t.mixed_precision_param, t.mixed_precision_reduce
