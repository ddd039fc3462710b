"""Llama-3.x frozen target (3.1 / 3.2 / 3.3 dense).

Llama-3 is the Qwen3 decoder without the per-head q/k norms and with Llama-3 RoPE frequency
scaling, so it reuses ``models.targets.qwen3``'s module (same HF parameter names) with ``qk_norm=False``.
"""

from __future__ import annotations

from dataclasses import fields, replace

from models.targets.qwen3 import Qwen3Args, Qwen3Model, load_hf_state_dict, load_hf_tables, qwen3_flavors, save_hf_checkpoint
from models.targets.qwen3.args import hf_decoder_kwargs
from titan_draft.protocols.target_spec import TargetSpec, register_target_spec


def args_from_hf_config(config: dict) -> Qwen3Args:
    """Target args from a Llama ``config.json`` dict."""
    if config.get("model_type") != "llama":
        raise ValueError(f"expected a llama config, got model_type={config.get('model_type')!r}")
    kwargs = hf_decoder_kwargs(config, {f.name for f in fields(Qwen3Args)})
    kwargs.setdefault("rope_theta", 500000.0)
    kwargs.setdefault("rms_norm_eps", 1e-5)
    return Qwen3Args(**{**kwargs, "qk_norm": False})


# the Qwen3 debug shape with Llama-3's vocabulary, norms, RoPE and untied head
TARGET_FLAVORS = {
    "debugmodel": replace(
        qwen3_flavors["debugmodel"],
        vocab_size=128256,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        qk_norm=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
}

register_target_spec(
    TargetSpec(
        family="llama3",
        model_types=("llama",),
        model_cls=Qwen3Model,
        args_from_hf_config=args_from_hf_config,
        load_hf_state_dict=load_hf_state_dict,
        load_tables=load_hf_tables,
        save_hf_checkpoint=save_hf_checkpoint,
        flavors=TARGET_FLAVORS,
    )
)

__all__ = ["TARGET_FLAVORS", "args_from_hf_config"]
