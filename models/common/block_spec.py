"""What every block-diffusion draft's ModelSpec resolves the same way: its args from the target
(``update_args_fn``), its capture layers (DFlash's rule) and its reserved mask token."""

from __future__ import annotations

from dataclasses import replace

from models.common.args import BlockDiffusionArgs
from titan_draft.data.chat_template import template_special_tokens

__all__ = ["backbone_shapes", "block_capture_layers", "reserved_tokens", "resolved_capture_layers", "update_block_args"]

# Follow the target unless [model.args] sets them: the draft rotates positions as the target
# does, is served up to the target's context length, and normalizes with the target's epsilon.
_FROM_TARGET = ("rope_theta", "max_position_embeddings", "rms_norm_eps")


def update_block_args(args: BlockDiffusionArgs, ctx, flavors: dict[str, BlockDiffusionArgs]) -> BlockDiffusionArgs:
    """A block-diffusion draft's ``update_args_fn``: target facts, capture layers, mask token,
    static anchors (``ctx`` is an :class:`~titan_draft.protocols.ArgsContext`; ``flavors`` name
    the ones of the target's width in the error)."""
    t = ctx.target
    if args.hidden_size != t.hidden_size:
        fits = sorted(name for name, f in flavors.items() if f.hidden_size == t.hidden_size)
        hint = f"; flavors of this width: {fits}" if fits else "; set model.args.hidden_size and the head sizes"
        raise ValueError(
            f"model: draft hidden_size {args.hidden_size} != target hidden_size {t.hidden_size} (the draft "
            f"embeds and predicts through the target's tables, so they must match){hint}"
        )
    layer_ids = list(ctx.job.target.capture_layers) or block_capture_layers(args, t.num_hidden_layers)
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


def resolved_capture_layers(args: BlockDiffusionArgs) -> list[int]:
    """The ModelSpec's ``capture_layers_fn``."""
    return list(args.target_layer_ids)


def reserved_tokens(args: BlockDiffusionArgs) -> list[int]:
    """The mask token: the data must never hold it (the draft reads it as "predict me")."""
    return [args.mask_token_id]


def block_capture_layers(args: BlockDiffusionArgs, num_target_layers: int) -> list[int]:
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


def backbone_shapes(args: BlockDiffusionArgs) -> dict[str, tuple[int, ...]]:
    """Serving key -> shape of the shared backbone's parameters (``fc``, ``hidden_norm``,
    ``norm``, ``layers.{i}``), the part of the SGLang contract every block-diffusion draft
    exports; a draft adds its own keys. ``target_layer_ids`` must be resolved."""
    h, d = args.hidden_size, args.head_dim
    q, kv, ff = args.num_attention_heads * d, args.num_key_value_heads * d, args.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (h, args.fc_in_features), "hidden_norm.weight": (h,),
                                          "norm.weight": (h,)}
    for i in range(args.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
            p + "mlp.gate_proj.weight": (ff, h), p + "mlp.up_proj.weight": (ff, h),
            p + "mlp.down_proj.weight": (h, ff),
        })
    return shapes
