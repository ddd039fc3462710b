"""parallelize_fn of the DFlash family: float8 -> activation checkpointing -> in-place compile ->
fully_shard per block, then the remaining trainable groups, then the root (torchtitan's order)."""

from __future__ import annotations

from torch import nn

from titan_draft.distributed.parallelize import (
    apply_ac,
    apply_compile,
    apply_fsdp,
    mixed_precision_dtypes,
)


def parallelize_dflash2(model: nn.Module, parallel_dims, job_config, float8=None, *, dp_mesh=None) -> nn.Module:
    # Only the blocks' Linears go to float8: fc sees K·H inputs once per step and the selector's
    # projection is small, so neither pays for the scaling overhead.
    if float8 is not None and float8.enabled:
        for idx, block in model.layers.items():
            float8.convert(block, fqn_prefix=f"layers.{idx}")
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model.layers, job_config.activation_checkpoint.mode)
    if job_config.compile.enable:
        apply_compile(model.layers, fullgraph=job_config.compile.fullgraph, backend=job_config.compile.backend)
    if dp_mesh is not None:
        param_dtype, reduce_dtype = mixed_precision_dtypes(job_config, dp_mesh.device_type)
        extra = [[model.fc, model.hidden_norm]]
        if getattr(model, "candidate_selector", None) is not None:
            extra.append([model.candidate_selector])
        apply_fsdp(
            model,
            dp_mesh,
            blocks=model.layers,
            extra_groups=extra,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            reshard_after_forward=job_config.parallelism.fsdp_reshard_after_forward,
        )
    return model
