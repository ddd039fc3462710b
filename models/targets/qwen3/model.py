"""Frozen Qwen3 target backbone that captures hidden states for draft training.

Submodule names equal HF's ``Qwen3ForCausalLM`` without the ``model.`` prefix, so an HF state
dict maps 1:1 (see ``state_dict.py``). The target is never trained: ``capture`` runs under
``no_grad``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.common.attention import AttentionMask, attention
from models.common.causal_documents import build_causal_document_mask
from models.common import (
    QKNormProjections,
    RMSNorm,
    SwiGLU,
    apply_rope,
    copy_full_,
    full_tensor,
    rope_cos_sin,
)
from models.targets.qwen3.args import Qwen3Args
from models.targets.qwen3.cache import DecodeStep, KVCache, LayerCache
from models.targets.qwen3.static_cache import StaticKVCache
from titan_draft.protocols.features import position_ids
from titan_draft.protocols.target_spec import check_capture_layer_ids


class Qwen3Attention(QKNormProjections):
    """Causal GQA self-attention with per-head q/k RMSNorm (Qwen3; none for Llama-3 and Qwen2)
    and, with ``args.qkv_bias``, biased q/k/v projections (Qwen2). Every target family runs this
    one attention, so what the capture path learns (packing, masks) reaches all of them."""

    def __init__(self, args):
        super().__init__(args)
        if getattr(args, "qkv_bias", False):
            for name in ("q_proj", "k_proj", "v_proj"):
                plain = getattr(self, name)
                setattr(self, name, nn.Linear(plain.in_features, plain.out_features, bias=True))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: LayerCache | None = None, mask: AttentionMask | None = None) -> torch.Tensor:
        """``mask``: packed rows' causal document mask (``build_causal_document_mask``)."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        gqa = self.n_heads != self.n_kv_heads
        if mask is not None:
            o = attention(q, k, v, mask)
        elif kv is None:
            # Padding sits at the end of each row, so plain causal attention is exact for real
            # tokens.
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            k, v = kv.update(k, v)
            o = cached_attention(q, k, v, kv.mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of ``q [B, H, T, D]`` over cached ``k, v [B, KV, S, D]`` under ``mask
    [B, 1, T, S]``. The ``H // KV`` query heads of each key head are folded into its query rows
    (head ``h`` reads key head ``h // (H // KV)``, as ``enable_gqa``): a masked GQA call would
    fall back to the math kernel, which copies every key and value per query head, while this
    one goes to the memory-efficient kernel at any batch."""
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    folded = q.reshape(b, k.shape[1], groups * t, d)
    if mask is not None:
        s = mask.shape[-1]
        mask = mask[:, :, None].expand(b, 1, groups, t, s).reshape(b, 1, groups * t, s)
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=mask).reshape(b, h, t, d)


class Qwen3DecoderLayer(nn.Module):
    """Attention then feed-forward, each pre-normed and residual. ``mlp``: the feed-forward
    module (default: the dense SwiGLU; a mixture-of-experts family passes its own)."""

    def __init__(self, args: Qwen3Args, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Qwen3Attention(args)
        self.mlp = mlp if mlp is not None else SwiGLU(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: LayerCache | None = None, mask: AttentionMask | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _call_layer(layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: AttentionMask | None = None) -> torch.Tensor:
    return layer(h, cos, sin, None, mask)


class Qwen3Model(nn.Module):
    """Qwen3 decoder (HF names: ``embed_tokens``, ``layers.{i}``, ``norm``, ``lm_head``).

    Capture-layer convention (SGLang's): layer id ``i`` is the unnormalized output of decoder
    layer ``i`` (0-indexed), i.e. HF ``output_hidden_states[i + 1]``; ``hidden_states[0]`` (the
    embeddings) has no id. The last hidden state is taken after the final ``norm``.
    """

    def __init__(self, args: Qwen3Args):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleDict({str(i): self.build_layer(i) for i in range(args.num_hidden_layers)})
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._capture_layer = _call_layer  # compile_capture swaps in a compiled one

    def build_layer(self, layer_id: int) -> nn.Module:
        """Decoder layer ``layer_id`` (a family whose layers differ, e.g. by their MLP,
        overrides this)."""
        return Qwen3DecoderLayer(self.args)

    def compile_capture(self, backend: str = "inductor") -> None:
        """Compile the decoder layer call of the capture path (no cache): one graph
        that every layer reuses, since their code and shapes are the same. Eager, the 28 layers
        SmolLM2 runs for a capture are ~1600 small ops (norms, RoPE and SwiGLU in many passes).
        Decoding with a cache stays eager, so the evals' CUDA graphs are untouched."""
        self._capture_layer = torch.compile(_call_layer, backend=backend)

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding again when the args tie them: ``to_empty`` after
        a meta-device build gives each module its own new parameter. Under FSDP2 the tie
        survives (DTensor parameters are swapped in place), so nothing is re-registered there."""
        if not self.args.tie_word_embeddings or self.lm_head.weight is self.embed_tokens.weight:
            return
        if isinstance(self.embed_tokens.weight, DTensor):
            raise RuntimeError("tied target embeddings were untied after fully_shard")
        self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic random weights for debug/benchmark targets: norms 1, linears normal
        std 0.02, embedding and lm_head normal std 1/sqrt(H). The wider tables give logits of
        std ~1 on a unit-RMS hidden state, the dynamic range of a trained model's head; with
        std 0.02 every logit is ~0 and a draft trained against it can barely lower its loss.

        Each parameter is drawn in full from one generator seeded with ``seed`` (parameters in
        registration order), so the values do not depend on how the model is sharded; they do
        depend on the device type (CPU and CUDA generators differ).
        """
        gens: dict[torch.device, torch.Generator] = {}
        table_std = 1.0 / self.args.hidden_size**0.5
        for name, p in self.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if local.device.type == "meta":
                raise RuntimeError(
                    f"init_weights: {name} is on the meta device; call to_empty first"
                )
            gen = gens.get(local.device)
            if gen is None:
                gen = gens[local.device] = torch.Generator(device=local.device).manual_seed(seed)
            if name.endswith("norm.weight"):
                value = torch.ones(p.shape, device=local.device)
            else:
                std = table_std if name in ("embed_tokens.weight", "lm_head.weight") else 0.02
                value = torch.empty(p.shape, device=local.device).normal_(0.0, std, generator=gen)
            copy_full_(p, value.to(p.dtype))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 angles (HF) unless the model itself runs in fp64
        dtype = torch.promote_types(self.embed_tokens.weight.dtype, torch.float32)
        return rope_cos_sin(positions, self.args.head_dim, self.args.rope_theta, dtype, self.args.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,
        layer_ids: list[int] | None = None,
        need_last_hidden: bool = True,
        *,
        cache: KVCache | None = None,
        logits: str = "all",
        document_ids: torch.Tensor | None = None,
    ):
        """``layer_ids=None``: logits ``[B, S, V]``; else ``(aux, last_hidden | None)`` as in
        :meth:`capture`. Capture goes through ``forward`` so FSDP2's root hooks (which unshard
        the embedding/norm/lm_head group) run; call :meth:`capture` rather than this form.

        With ``cache`` (see :meth:`new_cache`) the tokens continue the cached ones and a
        :class:`DecodeStep` is returned: ``logits`` ``'all'``, ``'last'`` or ``'none'``,
        capture-layer outputs for ``layer_ids`` (may be None), the final-norm hidden states
        when ``need_last_hidden``. The cache has advanced past the new tokens.
        """
        if cache is not None:
            return self._decode(input_ids, layer_ids, need_last_hidden, cache, logits)
        seq = input_ids.shape[1]
        mask = None
        if document_ids is None:
            pos = torch.arange(seq, device=input_ids.device).unsqueeze(0)
        else:  # packed rows: positions restart and attention stays inside each document
            pos = position_ids(document_ids, seq, input_ids.device)
            mask = build_causal_document_mask(torch.arange(seq, device=input_ids.device) - pos)  # document starts
        cos, sin = self._rope(pos)
        h = self.embed_tokens(input_ids)
        if layer_ids is None:
            for layer in self.layers.values():
                h = layer(h, cos, sin, None, mask)
            return self.lm_head(self.norm(h))

        wanted = set(layer_ids)
        last = len(self.layers) - 1 if need_last_hidden else max(layer_ids)
        outs: dict[int, torch.Tensor] = {}
        for i in range(last + 1):
            h = self._capture_layer(self.layers[str(i)], h, cos, sin, mask)
            if i in wanted:
                outs[i] = h
        aux = torch.cat([outs[i] for i in layer_ids], dim=-1)
        return aux, (self.norm(h) if need_last_hidden else None)

    def _decode(self, input_ids, layer_ids, need_last_hidden, cache: KVCache, logits: str) -> DecodeStep:
        if logits not in ("all", "last", "none"):
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {logits!r}")
        num_new = input_ids.shape[1]
        cos, sin = self._rope(cache.positions(num_new))
        mask = cache.attn_mask(num_new)
        wanted = set(layer_ids or ())
        outs: dict[int, torch.Tensor] = {}
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, cos, sin, LayerCache(cache, i, mask))
            if i in wanted:
                outs[i] = h
        cache.advance(num_new)
        normed = self.norm(h)
        out_logits = None
        if logits != "none":
            # fp32 logits: a bf16 lm_head rounds SmolLM2's logits to steps of 0.125 at their
            # magnitude, so greedy choices would often be exact ties broken by rounding noise
            rows = normed if logits == "all" else normed[:, -1:]
            acc = torch.promote_types(rows.dtype, torch.float32)
            out_logits = F.linear(rows.to(acc), self.lm_head.weight.to(acc))
        aux = torch.cat([outs[i] for i in layer_ids], dim=-1) if layer_ids else None
        return DecodeStep(logits=out_logits, aux=aux, last_hidden=normed if need_last_hidden else None)

    def new_cache(self, batch: int, max_len: int, pad: torch.Tensor | None = None, static: bool = False) -> KVCache:
        """An empty :class:`KVCache` for ``batch`` rows of up to ``max_len`` tokens, in the
        model's dtype and on its device (``pad``: left-padding per row; ``static``: the
        fixed-shape :class:`StaticKVCache` that CUDA graphs need)."""
        w = self.embed_tokens.weight
        local = w.to_local() if isinstance(w, DTensor) else w
        a = self.args
        return (StaticKVCache if static else KVCache)(a.num_hidden_layers, batch, max_len, a.num_key_value_heads, a.head_dim,
                       dtype=local.dtype, device=local.device, pad=pad)

    @torch.no_grad()
    def capture(
        self, input_ids: torch.Tensor, layer_ids: list[int], need_last_hidden: bool = True,
        document_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hidden states for draft training.

        Args:
            input_ids: ``[B, S]`` token ids, padding at the end of each row.
            layer_ids: capture layer ids (id ``i`` = output of decoder layer ``i`` =
                HF ``hidden_states[i + 1]``), concatenated in this order (repeats allowed).
            need_last_hidden: also return the final-norm last hidden state. When False, layers
                after ``max(layer_ids)`` are not run.
            document_ids: ``[B, S]`` for packed rows (``TargetFeatures.document_ids``): each
                document is captured as if it were alone (positions restart, attention stays
                inside it).

        Returns:
            ``aux [B, S, len(layer_ids) * H]`` and ``last_hidden [B, S, H]`` or None.
        """
        check_capture_layer_ids(layer_ids, len(self.layers))
        return self(input_ids, layer_ids=list(layer_ids), need_last_hidden=need_last_hidden,
                    document_ids=document_ids)

    def embed_weight(self) -> torch.Tensor:
        """The full ``[V, H]`` input embedding (all-gathered if sharded), detached."""
        return full_tensor(self.embed_tokens.weight).detach()

    def lm_head_weight(self) -> torch.Tensor:
        """The full ``[V, H]`` output projection (all-gathered if sharded), detached."""
        return full_tensor(self.lm_head.weight).detach()
