"""Export adapter: DSpark state dict <-> SGLang's DSpark draft (``--speculative-algorithm DSPARK``).

The training FQNs are the serving names: the backbone's keys plus ``markov_head.*`` and
``confidence_head.*``; the frozen tables are never exported (SGLang ignores ``embed_tokens.*`` /
``lm_head.*`` and uses the target's). config.json carries the fields SGLang reads at top level.
SGLang serves DeepSpec's slot convention only (slot k predicts the token k + 1 places after the
anchor), which is what this draft trains; the config says so under ``titan_draft``.
"""

from __future__ import annotations

import torch

from models.common.block_spec import backbone_shapes
from models.dspark.args import DSparkArgs

ARCHITECTURE = "DSparkDraftModel"
SLOT_CONVENTION = "deepspec: slot k of a block anchored at a predicts x[a + k + 1] (slot 0 included)"
_FORBIDDEN_FRAGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp")


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


def _check(tensors: dict[str, torch.Tensor], args: DSparkArgs, where: str) -> None:
    wrapped = sorted(k for k in tensors if any(f in k for f in _FORBIDDEN_FRAGMENTS))
    if wrapped:
        raise KeyError(f"{where}: wrapper prefixes in keys (compile/AC/FSDP leaked into FQNs): {wrapped}")
    shapes = expected_shapes(args)
    missing, unexpected = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or unexpected:
        raise KeyError(f"{where}: missing keys {missing}, unexpected keys {unexpected}")
    wrong = [f"{k}: {tuple(tensors[k].shape)} != {shapes[k]}" for k in sorted(shapes)
             if tuple(tensors[k].shape) != shapes[k]]
    if wrong:
        raise ValueError(f"{where}: shape mismatch: {wrong}")


def export_dspark(state_dict: dict[str, torch.Tensor], args: DSparkArgs, target_info: dict):
    """``(tensors, config.json)`` in the serving contract; refuses an incomplete draft (a missing
    head would be served silently as a zero bias or an always-confident head)."""
    for key in ("num_hidden_layers", "vocab_size", "hidden_size"):
        if key not in target_info:
            raise KeyError(f"export: target_info lacks {key!r}")
    if not args.target_layer_ids:
        raise ValueError("export: args.target_layer_ids is empty (capture layers unresolved)")
    t_hidden = args.target_hidden_size or args.hidden_size
    if target_info["vocab_size"] != args.vocab_size or target_info["hidden_size"] != t_hidden:
        raise ValueError(f"export: the draft (vocab {args.vocab_size}, target width {t_hidden}) was not trained "
                         f"for this target (vocab {target_info['vocab_size']}, width {target_info['hidden_size']})")
    bad = [i for i in args.target_layer_ids if not 0 <= i < target_info["num_hidden_layers"]]
    if bad:
        raise ValueError(f"export: target_layer_ids {bad} out of range for the target")
    frozen = sorted(k for k in state_dict if k.startswith(("target_", "embed", "lm_head")))
    if frozen:
        raise KeyError(f"export: frozen target tables must not be exported: {frozen}")
    _check(state_dict, args, "export")
    dtypes = {t.dtype for t in state_dict.values()}
    if len(dtypes) != 1:
        raise ValueError(f"export: mixed dtypes {sorted(str(d) for d in dtypes)}; cast first")
    config = {
        "architectures": [ARCHITECTURE],
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
        "torch_dtype": str(dtypes.pop()).removeprefix("torch."),
        "layer_types": ["full_attention"] * args.num_layers,
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
    }
    if t_hidden != args.hidden_size:
        config["target_hidden_size"] = t_hidden
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
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
            num_attention_heads=config["num_attention_heads"], num_key_value_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
            max_position_embeddings=config["max_position_embeddings"],
            block_size=field("block_size"), mask_token_id=field("mask_token_id"),
            target_layer_ids=list(field("target_layer_ids")), num_target_layers=config.get("num_target_layers", 0),
            target_hidden_size=config.get("target_hidden_size", 0), markov_rank=field("markov_rank"),
            markov_head_type=field("markov_head_type"), enable_confidence_head=bool(field("enable_confidence_head")),
            confidence_head_with_markov=bool(field("confidence_head_with_markov")),
            loss_gamma=(config.get("titan_draft") or {}).get("loss_gamma", 4.0),
        )
    except KeyError as e:
        raise ValueError(f"export config: missing field {e.args[0]!r}") from None
    args.check()
    _check(tensors, args, "export tensors")
    return args, dict(tensors)
