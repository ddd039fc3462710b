"""Attention helpers: one mask function, two backends.

A mask is written once as a flex ``mask_mod(b, h, q_idx, kv_idx) -> bool``. On CUDA it becomes a
``BlockMask`` for ``flex_attention``, which is always called through a compiled wrapper: eager
flex materializes the full score matrix. On CPU flex has no backward, so the same ``mask_mod`` is
evaluated densely into a boolean ``[B, 1, Q, KV]`` mask for ``scaled_dot_product_attention``.

``mask_mod`` must be written with broadcasting tensor ops (no Python branching on values), which
is what flex's vmap-based tracing requires anyway; the dense path evaluates it once on broadcast
index grids instead of through vmap.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from models.common.lazy_compile import LazyCompiled
from models.common.norm import RMSNorm

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
AttentionMask = BlockMask | torch.Tensor

ATTENTION_BACKENDS = ("auto", "flex", "sdpa")

# Eager flex_attention materializes the [Q, KV] score matrix, so on CUDA it is called compiled
# even from uncompiled blocks (inside a compiled block dynamo traces it into the block's graph).
_compiled_flex_attention = LazyCompiled(flex_attention)


def resolve_attention_backend(backend: str, device: torch.device | str) -> str:
    """``auto`` -> ``flex`` on CUDA, ``sdpa`` elsewhere; ``flex``/``sdpa`` are kept as asked.

    flex on CPU works for forward only (torch has no CPU flex backward); it is allowed so tests
    can compare both backends.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attn_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "sdpa"
    return backend


def dense_mask_from_mask_mod(
    mask_mod: MaskMod, B: int, Q_LEN: int, KV_LEN: int, device: torch.device | str
) -> torch.Tensor:
    """Evaluate ``mask_mod`` on broadcast index grids -> bool ``[B, 1, Q_LEN, KV_LEN]``."""
    b = torch.arange(B, device=device).view(B, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(Q_LEN, device=device).view(1, 1, Q_LEN, 1)
    kv = torch.arange(KV_LEN, device=device).view(1, 1, 1, KV_LEN)
    mask = mask_mod(b, h, q, kv)
    return mask.to(torch.bool).expand(B, 1, Q_LEN, KV_LEN)


def build_attention_mask(
    mask_mod: MaskMod,
    B: int,
    Q_LEN: int,
    KV_LEN: int,
    device: torch.device | str,
    backend: str = "auto",
) -> AttentionMask:
    """Build the mask for :func:`attention`: a ``BlockMask`` (flex) or a dense bool tensor (sdpa).

    The mask is the same for every head (``H=None``).
    """
    resolved = resolve_attention_backend(backend, device)
    if resolved == "sdpa":
        return dense_mask_from_mask_mod(mask_mod, B, Q_LEN, KV_LEN, device)
    # Built eagerly, on purpose: on an H200 (torch 2.11) a cold `_compile=True` build of the
    # DFlash mask at Q 8192 x KV 12288 took 240 s and recompiles for every new shape, while
    # the eager build takes ~10 ms and ~1 GiB of transient memory per sample, freed before the
    # blocks run (so it does not raise the step's peak).
    return create_block_mask(mask_mod, B, None, Q_LEN, KV_LEN, device=device)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None
) -> torch.Tensor:
    """Masked attention with GQA. ``q [B, Hq, Q, D]``, ``k/v [B, Hkv, KV, D]`` -> ``[B, Hq, Q, D]``.

    Dispatches on the mask type built by :func:`build_attention_mask` (None: every query sees
    every key, through sdpa); scale is ``1/sqrt(D)``.
    Every query row must see at least one key (an empty row gives NaN under sdpa).
    """
    gqa = q.shape[1] != k.shape[1]
    if isinstance(mask, BlockMask):
        return _flex(q, k, v, mask, gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, gqa: bool, **options):
    """flex_attention: compiled on CUDA; on CPU eager and forward-only, used only to check it
    against the dense path (compiling it on CPU would cost a C++ build for no benefit)."""
    if q.is_cuda:
        return _compiled_flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, **options)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention` and each query's log-sum-exp of its scaled scores ``[B, Hq, Q]`` (at
    least fp32), so its result can be merged with keys attended elsewhere (softmax over
    ``[lse, other scores]`` weighs this output against the other values). A row that sees no key
    of ``mask`` must see one of those other keys."""
    gqa = q.shape[1] != k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    if isinstance(mask, BlockMask):
        o, lse = _flex(q, k, v, mask, gqa, return_lse=True)
        return o, lse.to(acc)
    # dense (CPU, and the reference): sdpa returns no log-sum-exp, so the scores are explicit
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).to(acc), v.repeat_interleave(rep, 1).to(acc)
    scores = (q.to(acc) @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        # the dtype's lowest, not -inf: a row with no key gets a finite lse that exp() turns into
        # a weight of 0 against any real score when merged, and no NaN reaches the backward
        scores = scores.masked_fill(~mask, torch.finfo(acc).min)
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.exp(scores - lse[..., None]) @ v
    return o.to(q.dtype), lse


class QKNormProjections(torch.nn.Module):
    """The Qwen3 attention parameters: q/k/v/o projections (GQA, no bias) and per-head q/k
    RMSNorm (identity when ``args.qk_norm`` is False, as in Llama). Targets and drafts subclass
    it and differ only in what they attend to.

    ``args`` is any model args with hidden_size, num_attention_heads, num_key_value_heads,
    head_dim and rms_norm_eps (and optionally qk_norm, default True).
    """

    def __init__(self, args):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, d
        self.q_proj = torch.nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = torch.nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.v_proj = torch.nn.Linear(h, self.n_kv_heads * d, bias=False)
        self.o_proj = torch.nn.Linear(self.n_heads * d, h, bias=False)
        qk_norm = getattr(args, "qk_norm", True)
        self.q_norm = RMSNorm(d, args.rms_norm_eps) if qk_norm else torch.nn.Identity()
        self.k_norm = RMSNorm(d, args.rms_norm_eps) if qk_norm else torch.nn.Identity()
