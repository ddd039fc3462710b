"""Args of a block-diffusion draft: the decoder shape plus what the shared backbone needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.common.args import DecoderArgs


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
