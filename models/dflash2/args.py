"""DFlash2 / DFlash draft architecture, objective settings and flavors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from models.common.args import DecoderArgs
from titan_draft.data.chat_template import template_special_tokens


@dataclass
class DFlash2Args(DecoderArgs):
    """A DFlash / DFlash2 draft. The shape fields come from :class:`DecoderArgs`: ``hidden_size``
    must equal the target's (block tokens use the target's embedding), ``vocab_size`` is the
    target's (rows of its frozen embedding / lm_head)."""

    num_layers: int = 5
    """Number of draft layers (also the default number of capture layers)."""
    # --- block diffusion ---
    block_size: int = 16
    """Tokens per draft block b: the anchor plus b - 1 mask slots."""
    num_anchors: int = 512
    """Blocks sampled per sequence per step (an upper bound unless static_anchors)."""
    loss_gamma: float = 7.0
    """Slot k >= 1 has loss weight exp(-(k - 1) / loss_gamma)."""
    mask_token_id: int = 151669
    """Target embedding row used for the mask slots (an unused Qwen3 token)."""
    target_layer_ids: list[int] = field(default_factory=list)
    """Capture layer ids (SGLang convention); empty until resolved by capture_layers()."""
    num_target_layers: int = 0
    """Number of target layers; 0 until resolved."""
    target_hidden_size: int = 0
    """Target width H_t feeding fc (0: same as hidden_size)."""
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
    output_multiplier: float = 1.0
    """Logits = softcap(output_multiplier * lm_head(h)) (for CE, accuracy and the selector)."""
    final_logit_softcapping: float = 0.0
    """tanh softcap of the logits (0: off)."""
    # --- execution ---
    attn_backend: str = "auto"
    """'auto' (flex on CUDA, sdpa on CPU), 'flex' or 'sdpa'."""
    static_anchors: bool = False
    """Always use num_anchors blocks (padded with kept=False), so shapes never change; set by
    the trainer from training.static_shapes."""
    ce_chunk_rows: int = 2048
    """Rows per chunk of the lm_head + cross-entropy pass."""
    selector_topk_group: int = 128
    """How the selector's top-K candidates are taken from each chunk's logits: 0 with torch.topk,
    > 0 from the K best groups of that many columns by their max (same values, two cheap passes
    instead of one vocabulary-wide selection). 128 measured fastest on an H200 (2048 x 151936,
    K 16: 2.31 -> 1.05 ms per chunk; 64: 1.74, 256: 2.29; docs/performance.md); a vocabulary
    that is not a multiple of it uses torch.topk."""

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)

    @property
    def is_dflash2(self) -> bool:
        return self.conv_enabled or self.selector_enabled


# Follow the target unless [model.args] sets them: the draft rotates positions as the target
# does, is served up to the target's context length, and normalizes with the target's epsilon.
_FROM_TARGET = ("rope_theta", "max_position_embeddings", "rms_norm_eps")


def update_dflash2_args(args: DFlash2Args, ctx) -> DFlash2Args:
    """The ModelSpec's ``update_args_fn``: target facts, capture layers, mask token, static
    anchors (``ctx`` is an :class:`~titan_draft.protocols.ArgsContext`)."""
    t = ctx.target
    if args.hidden_size != t.hidden_size:
        fits = sorted(name for name, f in dflash2_flavors.items() if f.hidden_size == t.hidden_size)
        hint = f"; flavors of this width: {fits}" if fits else "; set model.args.hidden_size and the head sizes"
        raise ValueError(
            f"model: draft hidden_size {args.hidden_size} != target hidden_size {t.hidden_size} (the draft "
            f"embeds and predicts through the target's tables, so they must match){hint}"
        )
    layer_ids = list(ctx.job.target.capture_layers) or capture_layers(args, t.num_hidden_layers)
    bad = [i for i in layer_ids if not 0 <= i < t.num_hidden_layers]
    if bad:
        raise ValueError(f"target.capture_layers: ids {bad} are outside the target's {t.num_hidden_layers} layers")
    resolved = {k: getattr(t, k) for k in _FROM_TARGET if k not in ctx.overrides}
    if "mask_token_id" not in ctx.overrides:
        resolved["mask_token_id"] = ctx.tokenizer.unused_token_id(
            t.vocab_size, avoid=template_special_tokens(ctx.chat_template))
    return replace(
        args,
        **resolved,
        target_layer_ids=layer_ids,
        num_target_layers=t.num_hidden_layers,
        vocab_size=t.vocab_size,
        target_hidden_size=t.hidden_size,
        static_anchors=ctx.job.training.static_shapes,
    )


def resolved_capture_layers(args: DFlash2Args) -> list[int]:
    """The ModelSpec's ``capture_layers_fn``."""
    return list(args.target_layer_ids)


def reserved_tokens(args: DFlash2Args) -> list[int]:
    """The mask token: the data must never hold it (the draft reads it as "predict me")."""
    return [args.mask_token_id]


def capture_layers(args: DFlash2Args, num_target_layers: int) -> list[int]:
    """Capture layer ids for a target with ``num_target_layers`` layers.

    ``args.target_layer_ids`` if set, else DFlash's rule ``round(1 + i * (L - 4) / (n - 1))``
    for ``i < n = args.num_layers`` (``n = 1`` -> ``[L // 2]``); Qwen3-8B, 5 layers ->
    ``[1, 9, 17, 25, 33]``.
    """
    L, n = num_target_layers, args.num_layers
    if args.target_layer_ids:
        ids = list(args.target_layer_ids)
    elif n == 1:
        ids = [L // 2]
    else:
        ids = [int(round(1 + i * (L - 4) / (n - 1))) for i in range(n)]
    bad = [i for i in ids if not 0 <= i < L]
    if bad:
        raise ValueError(f"capture layer ids {bad} out of range for a {L}-layer target")
    return ids


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
