"""parallelize_fn of EAGLE-3: its one block (``midlayer``, kept at its serving FQN) and the
other trainable groups, for the shared helper."""

from __future__ import annotations

from torch import nn

from titan_draft.distributed.parallelize import parallelize_blocks

# the draft head sees every step's rows; it stays in high precision like the DFlash heads
FLOAT8_SKIP = ("fc", "lm_head")


def parallelize_eagle3(model: nn.Module, parallel_dims, job_config, *, dp_mesh=None) -> nn.Module:
    # the training-time test calls the midlayer, the norm and the lm_head once per step of the
    # unroll: as units of their own each call and its backward would gather them again (14 times
    # a step), so the whole draft (~0.4B parameters at the Qwen3-8B shape) is one unit, the root
    return parallelize_blocks(model, job_config, dp_mesh, blocks=(model, ["midlayer"]), shard_blocks=False)
