"""The decoder shape that target and draft args share (Qwen3/Llama-style layers)."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class BlockDiffusionArgs(DecoderArgs):
    """A block-diffusion draft (DFlash family, DSpark): the decoder shape plus what the shared
    backbone needs. ``hidden_size`` must equal the target's (block tokens use the target's
    embedding); ``vocab_size`` is the target's (rows of its frozen embedding / lm_head)."""

    num_layers: int = 5
    """Number of draft layers (also the default number of capture layers)."""
    block_size: int = 16
    """Slots per draft block b: the anchor plus b - 1 mask slots."""
    num_anchors: int = 512
    """Blocks sampled per sequence per step (an upper bound unless static_anchors)."""
    loss_gamma: float = 7.0
    """Decay of the per-slot loss weight along the block (the draft's objective says how)."""
    mask_token_id: int = 151669
    """Target embedding row used for the mask slots (resolved per target: a token the data
    never contains)."""
    target_layer_ids: list[int] = field(default_factory=list)
    """Capture layer ids (SGLang convention); empty until resolved from the target."""
    num_target_layers: int = 0
    """Number of target layers; 0 until resolved."""
    target_hidden_size: int = 0
    """Target width H_t feeding fc (0: same as hidden_size)."""
    attn_backend: str = "auto"
    """'auto' (flex on CUDA, sdpa on CPU), 'flex' or 'sdpa'."""
    static_anchors: bool = False
    """Always use num_anchors blocks (padded with kept=False), so shapes never change; set from
    training.static_shapes."""

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)
