"""parallelize_fn of the DFlash family: its blocks and its other trainable groups, for the shared
helper (AC -> in-place compile -> fully_shard per block, then the groups, then the root)."""

from __future__ import annotations

from torch import nn

from titan_draft.distributed.parallelize import parallelize_blocks

# Only the blocks' Linears go to float8: fc sees K*H inputs once per step and the selector's
# projection is small, so neither pays for the scaling overhead (ModelSpec.float8_skip).
FLOAT8_SKIP = ("fc", "candidate_selector")


def parallelize_dflash2(model: nn.Module, parallel_dims, job_config, *, dp_mesh=None) -> nn.Module:
    groups = [[model.fc, model.hidden_norm]]
    if getattr(model, "candidate_selector", None) is not None:
        groups.append([model.candidate_selector])
    return parallelize_blocks(model, job_config, dp_mesh, blocks=model.layers, groups=groups)
