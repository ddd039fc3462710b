"""What every block-diffusion draft's ModelSpec resolves the same way: its args from the target
(``update_args_fn``), its capture layers (DFlash's rule), its reserved mask token, and the part
of the serving contract the backbone fixes (its tensors' shapes, config.json's Qwen3 fields and
the export's refusals)."""

from __future__ import annotations

from dataclasses import replace

import torch

from models.block_diffusion.args import BlockDiffusionArgs
from models.common.serving import check_serving_tensors

__all__ = ["backbone_config", "backbone_fields", "backbone_shapes", "block_capture_layers", "check_block_export",
           "reserved_tokens", "resolved_capture_layers", "update_block_args"]

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
            t.vocab_size, avoid=ctx.chat.special_tokens)
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


# Fragments that wrappers add to FQNs (compile, activation checkpointing, FSDP); never served.
_FORBIDDEN_FRAGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp")


def check_block_export(state_dict: dict[str, torch.Tensor], args: BlockDiffusionArgs, target_info: dict,
                       shapes: dict[str, tuple[int, ...]]) -> torch.dtype:
    """Refuse an export that does not serve ``target_info``'s target (its ``num_hidden_layers``,
    ``vocab_size``, ``hidden_size``) or whose keys are not exactly ``shapes`` (the draft's
    :func:`backbone_shapes` plus its own); returns the one dtype of the tensors."""
    for key in ("num_hidden_layers", "vocab_size", "hidden_size"):
        if key not in target_info:
            raise KeyError(f"export: target_info lacks {key!r}")
    if not args.target_layer_ids:
        raise ValueError("export: args.target_layer_ids is empty (capture layers unresolved)")
    t_hidden = args.target_hidden_size or args.hidden_size
    if target_info["vocab_size"] != args.vocab_size or target_info["hidden_size"] != t_hidden:
        raise ValueError(f"export: the draft (vocab_size {args.vocab_size}, target hidden_size {t_hidden}) was not "
                         f"trained for this target (vocab_size {target_info['vocab_size']}, hidden_size "
                         f"{target_info['hidden_size']})")
    bad = [i for i in args.target_layer_ids if not 0 <= i < target_info["num_hidden_layers"]]
    if bad:
        raise ValueError(f"export: target_layer_ids {bad} out of range for the target")
    wrapped = sorted(k for k in state_dict if any(f in k for f in _FORBIDDEN_FRAGMENTS))
    if wrapped:
        raise KeyError(f"export: wrapper prefixes in keys (compile/AC/FSDP leaked into FQNs): {wrapped}")
    frozen = sorted(k for k in state_dict if k.startswith("target_") or "embed" in k or "lm_head" in k)
    if frozen:
        raise KeyError(f"export: frozen target tables must not be exported: {frozen}")
    check_serving_tensors(state_dict, shapes, "export")
    dtypes = {t.dtype for t in state_dict.values()}
    if len(dtypes) != 1:
        raise ValueError(f"export: mixed dtypes {sorted(str(d).removeprefix('torch.') for d in dtypes)}; cast first")
    return dtypes.pop()


def backbone_config(args: BlockDiffusionArgs, architecture: str, dtype: torch.dtype, draft_fields: dict) -> dict:
    """config.json of a block-diffusion draft: the Qwen3 fields SGLang builds the backbone from,
    then ``draft_fields`` (the draft's own, in the order it writes them), then
    ``target_hidden_size`` when the target is wider than the draft."""
    config = {
        "architectures": [architecture],
        "model_type": "qwen3",
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_position_embeddings,
        "vocab_size": args.vocab_size,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "layer_types": ["full_attention"] * args.num_layers,
        **draft_fields,
    }
    t_hidden = args.target_hidden_size or args.hidden_size
    if t_hidden != args.hidden_size:
        config["target_hidden_size"] = t_hidden
    return config


def backbone_fields(config: dict) -> dict:
    """The backbone's :class:`BlockDiffusionArgs` fields read back from a serving config.json
    (the inverse of :func:`backbone_config`'s Qwen3 part); KeyError names a missing one."""
    return dict(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
        num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        num_target_layers=config.get("num_target_layers", 0), target_hidden_size=config.get("target_hidden_size", 0),
    )
