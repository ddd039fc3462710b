"""Export adapter: DSpark state dict <-> SGLang's DSpark draft (``--speculative-algorithm DSPARK``).

The training FQNs are the serving names: the backbone's keys plus ``markov_head.*`` and
``confidence_head.*``; the frozen tables are never exported (SGLang ignores ``embed_tokens.*`` /
``lm_head.*`` and uses the target's). config.json carries the fields SGLang reads at top level.
SGLang serves DeepSpec's slot convention only (slot k predicts the token k + 1 places after the
anchor), which is what this draft trains; the config says so under ``titan_draft``.
"""

from __future__ import annotations

import torch

from models.block_diffusion.spec import backbone_config, backbone_fields, backbone_shapes, check_block_export
from models.common.serving import check_serving_tensors
from models.dspark.args import DSparkArgs

ARCHITECTURE = "DSparkDraftModel"
SLOT_CONVENTION = "deepspec: slot k of a block anchored at a predicts x[a + k + 1] (slot 0 included)"


def expected_shapes(args: DSparkArgs) -> dict[str, tuple[int, ...]]:
    """Serving key -> shape for these args (target_layer_ids must be resolved)."""
    h, v, r = args.hidden_size, args.vocab_size, args.markov_rank
    shapes = backbone_shapes(args)
    shapes["markov_head.markov_w1.weight"] = (v, r)
    shapes["markov_head.markov_w2.weight"] = (v, r)
    if args.markov_head_type == "gated":
        shapes["markov_head.gate_proj.weight"] = (r, h + r)
        shapes["markov_head.gate_proj.bias"] = (r,)
    elif args.markov_head_type == "rnn":
        shapes["markov_head.joint_proj.weight"] = (3 * r, 2 * r + h)
        shapes["markov_head.joint_proj.bias"] = (3 * r,)
    if args.enable_confidence_head:
        shapes["confidence_head.proj.weight"] = (1, h + (r if args.confidence_head_with_markov else 0))
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def export_dspark(state_dict: dict[str, torch.Tensor], args: DSparkArgs, target_info: dict):
    """``(tensors, config.json)`` in the serving contract; refuses an incomplete draft (a missing
    head would be served silently as a zero bias or an always-confident head)."""
    dtype = check_block_export(state_dict, args, target_info, expected_shapes(args))
    config = backbone_config(args, ARCHITECTURE, dtype, {
        "num_target_layers": target_info["num_hidden_layers"],
        # what SGLang's DSpark loader reads
        "block_size": args.block_size,
        "mask_token_id": args.mask_token_id,
        "target_layer_ids": list(args.target_layer_ids),
        "markov_rank": args.markov_rank,
        "markov_head_type": args.markov_head_type,
        "enable_confidence_head": args.enable_confidence_head,
        "confidence_head_with_markov": args.confidence_head_with_markov,
        # not read by SGLang: how this draft was trained
        "titan_draft": {"slot_convention": SLOT_CONVENTION, "loss_gamma": args.loss_gamma},
    })
    return {k: state_dict[k].detach().contiguous() for k in sorted(state_dict)}, config


def dspark_from_export(tensors: dict[str, torch.Tensor], config: dict) -> tuple[DSparkArgs, dict[str, torch.Tensor]]:
    """The inverse of :func:`export_dspark` (ours, or any DSpark folder in the serving contract;
    the DSpark fields may sit at top level or under ``dspark_config`` / ``dflash_config``).
    Training-only args keep their defaults; the tensors are checked against the shapes."""
    arch = (config.get("architectures") or [None])[0]
    if arch != ARCHITECTURE:
        raise ValueError(f"export config: architectures {config.get('architectures')!r} is not a DSpark draft")
    nested = {**(config.get("dflash_config") or {}), **(config.get("dspark_config") or {})}

    def field(name):
        if name in config:
            return config[name]
        if name in nested:
            return nested[name]
        raise ValueError(f"export config: missing field {name!r}")

    try:
        args = DSparkArgs(
            **backbone_fields(config),
            block_size=field("block_size"), mask_token_id=field("mask_token_id"),
            target_layer_ids=list(field("target_layer_ids")), markov_rank=field("markov_rank"),
            markov_head_type=field("markov_head_type"), enable_confidence_head=bool(field("enable_confidence_head")),
            confidence_head_with_markov=bool(field("confidence_head_with_markov")),
            loss_gamma=(config.get("titan_draft") or {}).get("loss_gamma", 4.0),
        )
    except KeyError as e:
        raise ValueError(f"export config: missing field {e.args[0]!r}") from None
    args.check()
    check_serving_tensors(tensors, expected_shapes(args), "export tensors")
    return args, dict(tensors)
