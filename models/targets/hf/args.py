"""Architecture facts of a target read through transformers: what the engine and the drafts ask
of a target's ``args`` (sizes, RoPE base), taken from the folder's ``config.json`` alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HFTargetArgs:
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rms_norm_eps: float
    """The family's norm epsilon (``rms_norm_eps``, else ``layer_norm_eps``): the draft's norms follow it."""

    @classmethod
    def from_hf_config(cls, config: dict) -> HFTargetArgs:
        """Args of a ``config.json`` dict; a ValueError naming the missing key. Multimodal
        folders nest the language model's facts under ``text_config``."""
        text = text_config(config)
        missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
        if missing:
            raise ValueError(f"config.json (model_type {config.get('model_type')!r}) has no {missing[0]}: "
                             "not a causal LM that the transformers backend can capture")
        # newer transformers keep the RoPE base under rope_parameters
        rope = text.get("rope_theta") or (text.get("rope_parameters") or {}).get("rope_theta") or 10000.0
        # max_position_embeddings 0 would give the draft no RoPE range: refuse it here
        if not text.get("max_position_embeddings"):
            raise ValueError(f"config.json (model_type {config.get('model_type')!r}) has no max_position_embeddings")
        return cls(
            model_type=str(config.get("model_type")),
            num_hidden_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            vocab_size=int(text["vocab_size"]),
            rope_theta=float(rope),
            max_position_embeddings=int(text["max_position_embeddings"]),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))),
            rms_norm_eps=float(text.get("rms_norm_eps") or text.get("layer_norm_eps") or 1e-6),
        )


def text_config(config: dict) -> dict:
    """The language model's part of a ``config.json`` dict: ``text_config`` in multimodal folders,
    else the dict itself."""
    return config.get("text_config") or config
