"""An independent FLOP count for a block-diffusion draft's training step, from the modules it
instantiates (a Linear that a draft's ``flops_fn`` forgets makes the two differ)."""

from __future__ import annotations

from torch import nn


def linear_flops(model: nn.Module, seq: int, rows: int) -> int:
    """6 * rows * in * out over every Linear of ``model``: ``fc`` sees the ``seq`` context
    positions, k/v projections the context and the ``rows`` block rows, the rest the block rows."""

    def rows_of(name: str) -> int:
        if name == "fc":
            return seq
        if name.endswith(("k_proj", "v_proj")):
            return seq + rows
        return rows

    return sum(6 * rows_of(name) * m.in_features * m.out_features
               for name, m in model.named_modules() if isinstance(m, nn.Linear))


def attention_flops(args, seq: int, rows: int) -> float:
    """Forward and backward (3 x) of QK^T and PV (4 x) per head: a block row attends to the
    context before its anchor (``seq / 2`` on average) and to its own block."""
    return 12 * rows * (seq / 2 + args.block_size) * args.num_attention_heads * args.head_dim * args.num_layers
