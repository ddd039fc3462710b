"""The decoder shape that target and draft args share (Qwen3/Llama-style layers)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecoderArgs:
    """Width, heads and RoPE of a Qwen3/Llama-style decoder; subclasses add their layer count and
    the rest. Defaults are Qwen3-8B's."""

    vocab_size: int = 151936
    """Vocabulary size (rows of the embedding and lm_head tables)."""
    hidden_size: int = 4096
    """Model width H."""
    intermediate_size: int = 12288
    """SwiGLU intermediate size."""
    num_attention_heads: int = 32
    """Query heads."""
    num_key_value_heads: int = 8
    """Key/value heads (GQA)."""
    head_dim: int = 128
    """Per-head size (set explicitly, as Qwen3 does: not always hidden_size / heads)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope_theta: float = 1e6
    """RoPE base."""
    max_position_embeddings: int = 40960
    """Longest position the model is meant for; written to config.json (RoPE is not tabled)."""
