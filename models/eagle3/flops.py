"""Model FLOPs of one EAGLE-3 training micro-step (for MFU)."""

from __future__ import annotations

from models.eagle3.args import Eagle3Args


def eagle3_flops(args: Eagle3Args, batch_size: int, seq_len: int) -> float:
    """Forward + backward model FLOPs of one micro-batch (no activation recompute counted).

    Per sample, with S = seq_len, K = ttt_steps, H = hidden_size:

    - ``fc`` (3H -> H) once on S rows: ``6 * S * 3H * H`` (fwd 2, bwd 4);
    - per TTT step, the decoder layer on S rows: q/k/v read 2H, o_proj, the SwiGLU MLP, and the
      trainable lm_head H -> draft_vocab_size, each ``6 * rows * in * out``;
    - per TTT step j, attention over S / 2 causal keys on average plus j diagonal ones:
      ``3 * 4 * S * (S / 2 + j) * n_heads * head_dim`` (QK^T and PV, fwd + bwd);
    - the teacher: the frozen target lm_head over the full vocabulary, forward only, once
      (every step reads the same distribution, shifted): ``2 * S * H * vocab_size``.

    Elementwise work (norms, RoPE, softmax, the loss) is not counted.
    """
    h, d, k = args.hidden_size, args.head_dim, args.ttt_steps
    s = seq_len
    q_out, kv_out = args.num_attention_heads * d, args.num_key_value_heads * d
    layer = 2 * h * q_out + 2 * (2 * h * kv_out) + q_out * h + 3 * h * args.intermediate_size
    linear = s * args.fc_in_features * h + k * s * (layer + h * args.draft_vocab_size)
    attn = sum(3 * 4 * s * (s / 2 + j) * args.num_attention_heads * d for j in range(k))
    teacher = 2 * s * h * args.vocab_size
    return float(batch_size * (6 * linear + attn + teacher))
