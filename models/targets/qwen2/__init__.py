"""Qwen2 / Qwen2.5 frozen target (HF ``model_type`` ``qwen2``).

Qwen2 is the Qwen3 decoder with biases on the q/k/v projections and without the per-head q/k
norms, so it runs ``models.targets.qwen3``'s module (same HF parameter names, the biases
included) with ``qkv_bias=True, qk_norm=False``. Its chat format is ChatML without thinking
tags (``data.chat_template = "chatml"``, which "auto" picks for a Qwen2 tokenizer); Qwen2.5's
own template adds a default system prompt, which ``data.system_prompt = "auto"`` reads from the
folder's template.
"""

from __future__ import annotations

from dataclasses import fields, replace

from models.targets.qwen3 import (
    Qwen3Args,
    Qwen3Model,
    load_hf_state_dict,
    load_hf_tables,
    qwen3_flavors,
    save_hf_checkpoint,
)
from models.targets.qwen3.args import hf_decoder_kwargs
from titan_draft.protocols.target_spec import TargetSpec, register_target_spec


def args_from_hf_config(config: dict) -> Qwen3Args:
    """Target args from a Qwen2 ``config.json`` dict (HF's Qwen2 defaults where a field is absent)."""
    if config.get("model_type") != "qwen2":
        raise ValueError(f"expected a qwen2 config, got model_type={config.get('model_type')!r}")
    kwargs = hf_decoder_kwargs(config, {f.name for f in fields(Qwen3Args)})
    kwargs.setdefault("rope_theta", 10000.0)
    kwargs.setdefault("max_position_embeddings", 32768)
    return Qwen3Args(**{**kwargs, "qk_norm": False, "qkv_bias": True})


# the Qwen3 debug shape with Qwen2's attention
TARGET_FLAVORS = {
    "debugmodel": replace(qwen3_flavors["debugmodel"], qk_norm=False, qkv_bias=True),
}

register_target_spec(
    TargetSpec(
        family="qwen2",
        model_types=("qwen2",),
        model_cls=Qwen3Model,
        args_from_hf_config=args_from_hf_config,
        load_hf_state_dict=load_hf_state_dict,
        load_tables=load_hf_tables,
        save_hf_checkpoint=save_hf_checkpoint,
        flavors=TARGET_FLAVORS,
        # Qwen2's q/k/v biases are part of the architecture (HF's Qwen2 has no switch for them)
        config_features=("attention_bias",),
    )
)

__all__ = ["TARGET_FLAVORS", "args_from_hf_config"]
