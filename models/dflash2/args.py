"""DFlash2 / DFlash draft architecture, objective settings and flavors."""

from __future__ import annotations

from dataclasses import dataclass, replace

from models.block_diffusion.args import BlockDiffusionArgs
from models.block_diffusion.spec import update_block_args


@dataclass
class DFlash2Args(BlockDiffusionArgs):
    """A DFlash / DFlash2 draft: the block-diffusion backbone's args (:class:`BlockDiffusionArgs`;
    slot k >= 1 has loss weight ``exp(-(k - 1) / loss_gamma)``) plus the convolutions, the
    candidate selector and the logit transform."""

    # --- DFlash2 grouped dynamic convolutions ---
    conv_enabled: bool = True
    """Wrap every attention and MLP sublayer in a grouped dynamic depthwise convolution."""
    conv_kernel_size: int = 2
    """Convolution taps (causal within the block)."""
    conv_group_size: int = 16
    """Channels sharing one dynamic kernel delta (must divide hidden_size)."""
    # --- DFlash2 candidate selector ---
    selector_enabled: bool = True
    """Train the candidate selector over the unary top-K."""
    selector_rank: int = 256
    """Rank r of the predecessor/successor codebooks and the hidden projection."""
    selector_top_k: int = 16
    """Candidates per slot (K)."""
    selector_loss_weight: float = 1.0
    """alpha: weight of the selector CE after warm-up and ramp."""
    selector_warmup_ratio: float = 0.0
    """Fraction of the total steps with alpha = 0."""
    selector_ramp_ratio: float = 0.0
    """Fraction of the total steps over which alpha ramps linearly to its value after warm-up."""
    selector_detach_unary: bool = False
    """Stop the selector CE's gradient through the unary logits."""
    soft_labels: bool = False
    """True: each slot's cross-entropy is against the target's distribution where it predicted the
    slot's token (as EAGLE-3 trains), which makes the job capture the target's final-norm hidden
    states (the whole target runs), and the selector's is against that distribution over its
    candidates (at T > 0 the selector's distribution is the draft's q there, so a selector trained
    on one token would sharpen q again); False: against the data's token (DFlash's definition)."""
    output_multiplier: float = 1.0
    """Logits = softcap(output_multiplier * lm_head(h)) (for CE, accuracy and the selector)."""
    final_logit_softcapping: float = 0.0
    """tanh softcap of the logits (0: off)."""
    # --- execution ---
    ce_chunk_rows: int = 2048
    """Rows per chunk of the lm_head + cross-entropy pass."""
    selector_topk_group: int = 128
    """How the selector's top-K candidates are taken from each chunk's logits: 0 with torch.topk,
    > 0 from the K best groups of that many columns by their max (same values, two cheap passes
    instead of one vocabulary-wide selection). 128 measured fastest on an H200 (2048 x 151936,
    K 16: 2.31 -> 1.05 ms per chunk; 64: 1.74, 256: 2.29; docs/performance.md); a vocabulary
    that is not a multiple of it uses torch.topk."""

    @property
    def is_dflash2(self) -> bool:
        return self.conv_enabled or self.selector_enabled


_debug = DFlash2Args(
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    block_size=8,
    num_anchors=16,
    loss_gamma=4.0,
    conv_kernel_size=2,
    conv_group_size=16,
    selector_rank=16,
    selector_top_k=8,
)

_qwen3_8b = DFlash2Args(
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    block_size=16,
    num_anchors=512,
    loss_gamma=7.0,
    # target_layer_ids left empty: DFlash's rule per target ([1, 9, 17, 25, 33] for the 36-layer
    # Qwen3-8B, [1, 8, 15, 22, 29] for the 32-layer Llama-3.1-8B)
    conv_kernel_size=2,
    conv_group_size=16,
    selector_rank=256,
    selector_top_k=16,
)

# SmolLM2-135M-Instruct's width and heads (the real target every machine can get from PyPI);
# three layers capture [1, 14, 27] of its 30. rope_theta, max positions and eps follow the target.
_smollm2 = DFlash2Args(
    hidden_size=576,
    intermediate_size=1536,
    num_layers=3,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    block_size=16,
    num_anchors=256,
    loss_gamma=7.0,
    conv_kernel_size=2,
    conv_group_size=16,
    selector_rank=128,
    selector_top_k=16,
    # 8 chunks of the 61440 loss rows of a 16 x 1024 batch instead of 30: the per-chunk host
    # work (matmuls, top-k, compiled statistics, their backward) was ~1/4 of the host's step
    # on an H200, which the GPU waited for; each chunk's [8192, 49152] logits are 0.8 GB in bf16
    ce_chunk_rows=8192,
)

dflash2_flavors: dict[str, DFlash2Args] = {
    "debugmodel": _debug,
    "qwen3_8b": _qwen3_8b,
    "smollm2": _smollm2,
    "dflash_smollm2": replace(_smollm2, conv_enabled=False, selector_enabled=False),
    "dflash_debugmodel": replace(
        _debug, conv_enabled=False, selector_enabled=False, target_layer_ids=[]
    ),
    "dflash_qwen3_8b": replace(_qwen3_8b, conv_enabled=False, selector_enabled=False),
}


def update_dflash2_args(args: DFlash2Args, ctx) -> DFlash2Args:
    """The ModelSpec's ``update_args_fn`` (the backbone's, with these flavors as hints)."""
    return update_block_args(args, ctx, dflash2_flavors)


def reads_last_hidden(args: DFlash2Args) -> bool:
    """Whether training reads ``TargetFeatures.last_hidden``: only for ``soft_labels``."""
    return bool(args.soft_labels)
