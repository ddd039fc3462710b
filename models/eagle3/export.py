"""Export adapter: draft state dict <-> SGLang ``LlamaForCausalLMEagle3``.

The training FQNs are the serving names, ``d2t`` / ``t2d`` included; the frozen tables are not
exported (SGLang substitutes the target's embedding). An export missing any required key is
refused: SGLang would silently load the target's lm_head in place of a missing one.
"""

from __future__ import annotations

import torch

from models.common.serving import check_serving_tensors
from models.eagle3.args import Eagle3Args


def expected_shapes(args: Eagle3Args) -> dict[str, tuple[int, ...]]:
    h, d = args.hidden_size, args.head_dim
    p = "midlayer."
    return {
        "fc.weight": (h, args.fc_in_features),
        p + "input_layernorm.weight": (h,),
        p + "hidden_norm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (args.num_attention_heads * d, 2 * h),
        p + "self_attn.k_proj.weight": (args.num_key_value_heads * d, 2 * h),
        p + "self_attn.v_proj.weight": (args.num_key_value_heads * d, 2 * h),
        p + "self_attn.o_proj.weight": (h, args.num_attention_heads * d),
        p + "mlp.gate_proj.weight": (args.intermediate_size, h),
        p + "mlp.up_proj.weight": (args.intermediate_size, h),
        p + "mlp.down_proj.weight": (h, args.intermediate_size),
        "norm.weight": (h,),
        "lm_head.weight": (args.draft_vocab_size, h),
        "d2t": (args.draft_vocab_size,),
        "t2d": (args.vocab_size,),
    }


def _check(tensors: dict[str, torch.Tensor], args: Eagle3Args, where: str) -> None:
    check_serving_tensors(tensors, expected_shapes(args), where)
    if tensors["d2t"].dtype != torch.int64 or tensors["t2d"].dtype != torch.bool:
        raise ValueError(f"{where}: d2t must be int64 and t2d bool")


def export_eagle3(state_dict: dict[str, torch.Tensor], args: Eagle3Args, target_info: dict):
    """``(tensors, config.json)`` in the serving contract."""
    if target_info["vocab_size"] != args.vocab_size or target_info["hidden_size"] != (args.target_hidden_size or args.hidden_size):
        raise ValueError("export: the draft was not trained for this target (vocab or width differ)")
    _check(state_dict, args, "export")
    floats = {t.dtype for k, t in state_dict.items() if t.is_floating_point()}
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size,
        "num_attention_heads": args.num_attention_heads,
        "num_key_value_heads": args.num_key_value_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": args.rms_norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_position_embeddings,
        "vocab_size": args.vocab_size,
        "draft_vocab_size": args.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(floats.pop()).removeprefix("torch.") if len(floats) == 1 else "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(args.target_layer_ids),
                         "use_aux_hidden_state": True},
        # not read by SGLang (its chain length is --speculative-num-steps): the trained unroll,
        # which the true-tau eval uses as its chain length
        "titan_draft": {"ttt_steps": args.ttt_steps},
    }
    if args.target_hidden_size and args.target_hidden_size != args.hidden_size:
        config["target_hidden_size"] = args.target_hidden_size
    return {k: state_dict[k].detach().contiguous() for k in sorted(state_dict)}, config


def eagle3_from_export(tensors: dict[str, torch.Tensor], config: dict):
    """``(args, state dict)`` of an exported EAGLE-3 draft (ours or another trainer's)."""
    if (config.get("architectures") or [None])[0] != "LlamaForCausalLMEagle3":
        raise ValueError(f"export config: architectures {config.get('architectures')!r} is not an EAGLE-3 draft")
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    try:
        args = Eagle3Args(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"], num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config["num_key_value_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            rms_norm_eps=config["rms_norm_eps"], rope_theta=config["rope_theta"],
            max_position_embeddings=config["max_position_embeddings"],
            draft_vocab_size=config["draft_vocab_size"], target_layer_ids=list(ids),
            target_hidden_size=config.get("target_hidden_size", 0),
            ttt_steps=(config.get("titan_draft") or {}).get("ttt_steps", 7),
        )
    except (KeyError, TypeError) as e:
        raise ValueError(f"export config: missing field {e}") from None
    _check(tensors, args, "export tensors")
    return args, dict(tensors)
