"""Layers shared by targets and drafts."""

from models.common.attention import (
    ATTENTION_BACKENDS,
    QKNormProjections,
    attention,
    attention_with_lse,
    build_attention_mask,
    dense_mask_from_mask_mod,
    resolve_attention_backend,
)
from models.common.cross_entropy import ChunkedCEOutput, chunked_cross_entropy, transform_logits
from models.common.mlp import SwiGLU
from models.common.norm import RMSNorm
from models.common.rope import apply_rope, rope_cos_sin, rope_inv_freq, rotate_half
from models.common.tensor_utils import copy_full_, full_tensor

__all__ = [
    "ATTENTION_BACKENDS",
    "ChunkedCEOutput",
    "QKNormProjections",
    "RMSNorm",
    "SwiGLU",
    "apply_rope",
    "attention",
    "attention_with_lse",
    "build_attention_mask",
    "chunked_cross_entropy",
    "copy_full_",
    "dense_mask_from_mask_mod",
    "full_tensor",
    "resolve_attention_backend",
    "rope_cos_sin",
    "rope_inv_freq",
    "rotate_half",
    "transform_logits",
]
