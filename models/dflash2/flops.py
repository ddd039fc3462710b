"""Model FLOPs of one DFlash2 training micro-step (for MFU)."""

from __future__ import annotations

from models.dflash2.args import DFlash2Args


def dflash2_flops(args: DFlash2Args, batch_size: int, seq_len: int) -> float:
    """Forward + backward model FLOPs of one micro-batch (no activation recompute counted).

    Per sample, with S = seq_len, N = num_anchors (the static anchor capacity; dynamic runs use
    at most this many), b = block_size, R = N * b block rows:

    - trainable Linear ``in -> out`` on ``rows`` rows: ``6 * rows * in * out`` (fwd 2, bwd 4):
      ``fc`` on S rows; ``k_proj``/``v_proj`` on S + R rows; ``q_proj``, ``o_proj``, the MLP,
      the conv ``kernel_projection`` (conv on) and the selector ``hidden_projection``
      (selector on) on R rows;
    - frozen lm_head, forward + input gradient only: ``4 * N * (b - 1) * H * V`` (slot 0 rows
      are dropped before the lm_head);
    - attention: ``3 * 4 * R * KV * n_heads * head_dim`` (QK^T and PV, fwd + bwd) with
      ``KV = S / 2 + b`` attended keys per query (mean context length plus its own block).

    Elementwise work (norms, RoPE, the conv taps, the selector's K x r scores) is not counted.
    """
    h, d, v = args.hidden_size, args.head_dim, args.vocab_size
    s, b = seq_len, args.block_size
    n = args.num_anchors
    r = n * b
    q_out, kv_out = args.num_attention_heads * d, args.num_key_value_heads * d

    per_layer = (
        r * h * q_out  # q_proj
        + 2 * (s + r) * h * kv_out  # k_proj, v_proj on [context ; block]
        + r * q_out * h  # o_proj
        + 3 * r * h * args.intermediate_size  # gate, up, down
    )
    if args.conv_enabled:
        per_layer += 2 * r * h * (2 * args.conv_kernel_size * h // args.conv_group_size)
    linear = args.num_layers * per_layer + s * args.fc_in_features * h
    if args.selector_enabled:
        linear += r * h * args.selector_rank
    lm_head = 4 * n * (b - 1) * h * v
    attn = 3 * 4 * r * (s / 2 + b) * args.num_attention_heads * d * args.num_layers
    return float(batch_size * (6 * linear + lm_head + attn))
