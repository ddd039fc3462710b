"""parallelize_fn of DSpark: the backbone's blocks and ``[fc, hidden_norm]`` for the shared helper
(AC -> in-place compile -> fully_shard per block, then the group, then the root)."""

from __future__ import annotations

from torch import nn

from titan_draft.distributed.parallelize import parallelize_blocks

# Only the blocks' Linears go to float8: fc sees K*H inputs once per step, and the heads are
# rank-r projections (the confidence head has one output row), too small to pay for scaling.
FLOAT8_SKIP = ("fc", "markov_head", "confidence_head")


def parallelize_dspark(model: nn.Module, parallel_dims, job_config, *, dp_mesh=None) -> nn.Module:
    # The heads stay in the root's FSDP unit: the chunked loss reads markov_w2.weight directly
    # (outside the head's forward), which is unsharded only while the root's forward runs.
    return parallelize_blocks(model, job_config, dp_mesh, blocks=model.layers, groups=[[model.fc, model.hidden_norm]])
