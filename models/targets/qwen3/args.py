"""Qwen3 (dense) target architecture and flavors."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from models.common.args import DecoderArgs
from models.common.rope import rope_inv_freq


def hf_decoder_kwargs(config: dict, names: set[str]) -> dict:
    """The fields of an HF decoder config.json that the target args know. Handles both the
    ``rope_theta`` + ``rope_scaling`` spelling and transformers 5's ``rope_parameters``."""
    kwargs = {k: v for k, v in config.items() if k in names}
    rope = config.get("rope_parameters")
    if rope:
        if "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        kind = rope.get("rope_type", rope.get("type", "default"))
        kwargs["rope_scaling"] = None if kind == "default" else dict(rope)
    if config.get("head_dim") is None:
        kwargs["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    return kwargs


@dataclass
class Qwen3Args(DecoderArgs):
    """A Qwen3 (or, with ``qk_norm=False``, Llama-3) target; the shape fields come from
    :class:`DecoderArgs`."""

    num_hidden_layers: int = 36
    """Number of decoder layers L."""
    tie_word_embeddings: bool = False
    """lm_head shares the embedding matrix."""
    qk_norm: bool = True
    """Per-head RMSNorm on q and k (Qwen3); False gives the Llama-3 attention."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2/Qwen2.5; never on o_proj)."""
    rope_scaling: dict | None = None
    """HF ``rope_scaling`` (Llama-3.1+: rope_type llama3, factor, low/high_freq_factor,
    original_max_position_embeddings); None for plain RoPE."""

    @classmethod
    def from_hf_config(cls, config: dict) -> "Qwen3Args":
        """Build from an HF ``config.json`` dict (unknown HF fields are ignored)."""
        if config.get("model_type") not in (None, "qwen3"):
            raise ValueError(
                f"expected a qwen3 config, got model_type={config.get('model_type')!r}"
            )
        return cls(**hf_decoder_kwargs(config, {f.name for f in fields(cls)}))

    def __post_init__(self):
        # an unsupported rope_scaling fails here, when the folder is read, not at the first step
        rope_inv_freq(self.head_dim, self.rope_theta, scaling=self.rope_scaling)

    def to_hf_config(self, torch_dtype: str = "bfloat16") -> dict:
        """``config.json`` dict of an HF ``Qwen3ForCausalLM`` (``LlamaForCausalLM`` when
        ``qk_norm`` is False, ``Qwen2ForCausalLM`` with ``qkv_bias``) with these args; the
        family's ``args_from_hf_config`` reads it back."""
        qwen3 = self.qk_norm
        model_type = "qwen3" if qwen3 else ("qwen2" if self.qkv_bias else "llama")
        cfg = {
            "architectures": [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                               "llama": "LlamaForCausalLM"}[model_type]],
            "model_type": model_type,
            **{f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("qk_norm", "qkv_bias")},
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": True,
            "torch_dtype": torch_dtype,
        }
        if model_type == "llama":
            cfg["mlp_bias"] = False
        else:
            cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_hidden_layers)
        if model_type == "qwen2":  # HF's Qwen2 has its q/k/v biases always, and no switch for them
            del cfg["attention_bias"]
        return cfg

    @classmethod
    def from_hf_folder(cls, folder: str) -> "Qwen3Args":
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in target folder {folder!r}")
        with open(path) as f:
            return cls.from_hf_config(json.load(f))


qwen3_flavors: dict[str, Qwen3Args] = {
    "debugmodel": Qwen3Args(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    ),
    "qwen3_8b": Qwen3Args(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
}
