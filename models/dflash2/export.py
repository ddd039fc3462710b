"""Export adapter: draft state dict -> SGLang ``DFlash2DraftModel`` / ``DFlashDraftModel``.

The training FQNs already are the serving names, so the export is a strict check plus a
config.json; anything unexpected (frozen tables, wrapper prefixes) is an error, never skipped.
"""

from __future__ import annotations

import torch

from models.block_diffusion.spec import backbone_config, backbone_fields, backbone_shapes, check_block_export
from models.common.serving import check_serving_tensors
from models.dflash2.args import DFlash2Args


def expected_shapes(args: DFlash2Args) -> dict[str, tuple[int, ...]]:
    """Serving key -> shape for these args (target_layer_ids must be resolved): the backbone's,
    each layer's two convolutions, the candidate selector."""
    h, v = args.hidden_size, args.vocab_size
    shapes = backbone_shapes(args)
    if args.conv_enabled:
        taps, groups = args.conv_kernel_size, h // args.conv_group_size
        for i in range(args.num_layers):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = (2, taps, h)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * taps * groups, h)
    if args.selector_enabled:
        r = args.selector_rank
        shapes["candidate_selector.hidden_projection.weight"] = (r, h)
        shapes["candidate_selector.predecessor_codebook"] = (v, r)
        shapes["candidate_selector.successor_codebook"] = (v, r)
    return shapes


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
    dtype = check_block_export(state_dict, args, target_info, expected_shapes(args))
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
    config = backbone_config(args, "DFlash2DraftModel" if args.is_dflash2 else "DFlashDraftModel", dtype, {
        "block_size": args.block_size,
        "num_target_layers": target_info["num_hidden_layers"],
        "dflash_config": dflash_config,
    })
    return {k: state_dict[k].detach().contiguous() for k in sorted(state_dict)}, config


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
            **backbone_fields(config),
            block_size=config["block_size"],
            mask_token_id=dflash["mask_token_id"],
            target_layer_ids=list(dflash["target_layer_ids"]),
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
    try:
        check_serving_tensors(tensors, expected_shapes(args), "export tensors")
    except KeyError as e:  # a folder that does not match its config is bad input: one line in the eval CLI
        raise ValueError(e.args[0]) from None
    return args, dict(tensors)
