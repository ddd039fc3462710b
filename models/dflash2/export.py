"""Export adapter: draft state dict -> SGLang ``DFlash2DraftModel`` / ``DFlashDraftModel``.

The training FQNs already are the serving names, so the export is a strict check plus a
config.json; anything unexpected (frozen tables, wrapper prefixes) is an error, never skipped.
"""

from __future__ import annotations

import torch

from models.dflash2.args import DFlash2Args

# Fragments that wrappers add to FQNs; an export must never contain them.
_FORBIDDEN_FRAGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp")


def expected_shapes(args: DFlash2Args) -> dict[str, tuple[int, ...]]:
    """Serving key -> shape for these args (target_layer_ids must be resolved)."""
    h, d, v = args.hidden_size, args.head_dim, args.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, args.fc_in_features),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(args.num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (args.num_attention_heads * d, h),
                p + "self_attn.k_proj.weight": (args.num_key_value_heads * d, h),
                p + "self_attn.v_proj.weight": (args.num_key_value_heads * d, h),
                p + "self_attn.o_proj.weight": (h, args.num_attention_heads * d),
                p + "self_attn.q_norm.weight": (d,),
                p + "self_attn.k_norm.weight": (d,),
                p + "mlp.gate_proj.weight": (args.intermediate_size, h),
                p + "mlp.up_proj.weight": (args.intermediate_size, h),
                p + "mlp.down_proj.weight": (h, args.intermediate_size),
            }
        )
        if args.conv_enabled:
            taps, groups = args.conv_kernel_size, h // args.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                shapes[p + f"{conv}.base_kernel"] = (2, taps, h)
                shapes[p + f"{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
    if args.selector_enabled:
        r = args.selector_rank
        shapes["candidate_selector.hidden_projection.weight"] = (r, h)
        shapes["candidate_selector.predecessor_codebook"] = (v, r)
        shapes["candidate_selector.successor_codebook"] = (v, r)
    return shapes


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_dflash2(
    state_dict: dict[str, torch.Tensor], args: DFlash2Args, target_info: dict
) -> tuple[dict[str, torch.Tensor], dict]:
    """Check ``state_dict`` against the serving contract and build config.json.

    Args:
        state_dict: the full (unsharded) draft state dict, already in the export dtype.
        args: the draft args the checkpoint was trained with (capture layers resolved).
        target_info: the target's ``num_hidden_layers``, ``vocab_size`` and ``hidden_size``.

    Returns:
        ``(tensors, config)``: the tensors unchanged (detached, contiguous) and the config dict.
        ``torch_dtype`` is the tensors' floating dtype ("bfloat16" for a bf16 export).
    """
    for key in ("num_hidden_layers", "vocab_size", "hidden_size"):
        if key not in target_info:
            raise KeyError(f"target_info lacks {key!r}")
    if not args.target_layer_ids:
        raise ValueError("export: args.target_layer_ids is empty (capture layers unresolved)")
    if target_info["vocab_size"] != args.vocab_size:
        raise ValueError(
            f"export: draft vocab_size {args.vocab_size} != "
            f"target vocab_size {target_info['vocab_size']}"
        )
    t_hidden = args.target_hidden_size or args.hidden_size
    if target_info["hidden_size"] != t_hidden:
        raise ValueError(
            f"export: target hidden_size {target_info['hidden_size']} != draft's {t_hidden}"
        )
    bad_ids = [i for i in args.target_layer_ids if not 0 <= i < target_info["num_hidden_layers"]]
    if bad_ids:
        raise ValueError(f"export: target_layer_ids {bad_ids} out of range for the target")

    wrapped = sorted(k for k in state_dict if any(f in k for f in _FORBIDDEN_FRAGMENTS))
    if wrapped:
        raise KeyError(
            f"export: wrapper prefixes in keys (compile/AC/FSDP leaked into FQNs): {wrapped}"
        )
    frozen = sorted(k for k in state_dict if "embed" in k or "lm_head" in k)
    if frozen:
        raise KeyError(f"export: frozen target tables must not be exported: {frozen}")
    shapes = expected_shapes(args)
    missing = sorted(set(shapes) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(shapes))
    if missing or unexpected:
        raise KeyError(f"export: missing keys {missing}, unexpected keys {unexpected}")
    wrong = [
        f"{k}: {tuple(state_dict[k].shape)} != {shapes[k]}"
        for k in sorted(shapes)
        if tuple(state_dict[k].shape) != shapes[k]
    ]
    if wrong:
        raise ValueError(f"export: shape mismatch: {wrong}")
    dtypes = {state_dict[k].dtype for k in shapes}
    if len(dtypes) != 1:
        raise ValueError(
            f"export: mixed dtypes {sorted(_dtype_name(d) for d in dtypes)}; cast first"
        )
    tensors = {k: state_dict[k].detach().contiguous() for k in sorted(shapes)}

    dflash_config: dict = {
        "mask_token_id": args.mask_token_id,
        "target_layer_ids": list(args.target_layer_ids),
    }
    if args.is_dflash2:
        dflash_config.update(
            conv_kernel_size=args.conv_kernel_size if args.conv_enabled else 0,
            conv_group_size=args.conv_group_size if args.conv_enabled else 0,
            selector_rank=args.selector_rank if args.selector_enabled else 0,
            selector_top_k=args.selector_top_k if args.selector_enabled else 0,
        )
        if args.output_multiplier != 1.0:
            dflash_config["output_multiplier"] = args.output_multiplier
        if args.final_logit_softcapping > 0.0:
            dflash_config["final_logit_softcapping"] = args.final_logit_softcapping

    config = {
        "architectures": ["DFlash2DraftModel" if args.is_dflash2 else "DFlashDraftModel"],
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
        "torch_dtype": _dtype_name(dtypes.pop()),
        "layer_types": ["full_attention"] * args.num_layers,
        "block_size": args.block_size,
        "num_target_layers": target_info["num_hidden_layers"],
        "dflash_config": dflash_config,
    }
    if t_hidden != args.hidden_size:
        config["target_hidden_size"] = t_hidden
    return tensors, config


def dflash2_from_export(tensors: dict[str, torch.Tensor], config: dict) -> tuple[DFlash2Args, dict[str, torch.Tensor]]:
    """The inverse of :func:`export_dflash2`: draft args and state dict of an exported folder
    (ours, or any DFlash / DFlash2 checkpoint in the SGLang serving contract).

    Training-only args (anchors, loss weights) keep their defaults; everything decoding needs
    (shape, block size, mask token, capture layers, convolutions, selector, logit transform)
    comes from ``config``. The tensors are checked against the shapes these args imply.
    """
    arch = (config.get("architectures") or [None])[0]
    if arch not in ("DFlash2DraftModel", "DFlashDraftModel"):
        raise ValueError(f"export config: architectures {config.get('architectures')!r} is not a DFlash draft")
    dflash = config.get("dflash_config") or {}
    try:
        args = DFlash2Args(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            rms_norm_eps=config["rms_norm_eps"],
            rope_theta=config["rope_theta"],
            max_position_embeddings=config["max_position_embeddings"],
            block_size=config["block_size"],
            mask_token_id=dflash["mask_token_id"],
            target_layer_ids=list(dflash["target_layer_ids"]),
            num_target_layers=config.get("num_target_layers", 0),
            target_hidden_size=config.get("target_hidden_size", 0),
            conv_enabled=bool(dflash.get("conv_kernel_size", 0)),
            conv_kernel_size=dflash.get("conv_kernel_size") or 2,
            conv_group_size=dflash.get("conv_group_size") or 16,
            selector_enabled=bool(dflash.get("selector_rank", 0)),
            selector_rank=dflash.get("selector_rank") or 256,
            selector_top_k=dflash.get("selector_top_k") or 16,
            output_multiplier=dflash.get("output_multiplier", 1.0),
            final_logit_softcapping=dflash.get("final_logit_softcapping", 0.0),
        )
    except KeyError as e:
        raise ValueError(f"export config: missing field {e.args[0]!r}") from None
    shapes = expected_shapes(args)
    missing, unexpected = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        raise ValueError(f"export tensors: missing {missing}, unexpected {unexpected}")
    wrong = [k for k in shapes if tuple(tensors[k].shape) != shapes[k]]
    if wrong:
        raise ValueError(f"export tensors: shape mismatch for {wrong}")
    return args, dict(tensors)
