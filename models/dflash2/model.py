"""DFlash2 draft: DFlash backbone + grouped dynamic convolutions + candidate selector.

Parameter FQNs are exactly the serving names of SGLang's ``DFlash2DraftModel`` /
``DFlashDraftModel`` (see export.py). The target's embedding and lm_head are non-persistent
buffers: loaded from the target, never trained, never in a state dict.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.common import (
    QKNormProjections,
    RMSNorm,
    SwiGLU,
    apply_rope,
    attention,
    build_attention_mask,
    rope_cos_sin,
)
from models.dflash2.args import DFlash2Args
from models.dflash2.conv import GroupedDynamicConv
from models.dflash2.objective import (
    DraftBlocks,
    build_blocks,
    dflash_objective,
    make_mask_mod,
    sample_anchors,
)
from models.dflash2.selector import CandidateSelector
from titan_draft.protocols.features import DraftOutput, TargetFeatures

Rope = tuple[torch.Tensor, torch.Tensor]


class DFlash2Attention(QKNormProjections):
    """Block queries attend to [context ; block] keys through the same k/v projections."""

    def keys_values(self, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v [B, kv_heads, L, D]`` of rows ``h [B, L, H]`` (k normed and rotated): the
        context part is all a decoding draft caches, since it does not depend on the block."""
        bsz, rows, _ = h.shape
        k = self.k_norm(self.k_proj(h).view(bsz, rows, self.n_kv_heads, self.head_dim))
        v = self.v_proj(h).view(bsz, rows, self.n_kv_heads, self.head_dim)
        return apply_rope(k.transpose(1, 2), *rope), v.transpose(1, 2)

    def forward(self, x, ctx, rope_q: Rope, rope_k: Rope, attn_mask) -> torch.Tensor:
        """``ctx`` is the ``[B, S, H]`` context (``rope_k`` then covers context and block
        positions) or its cached ``(k, v)`` from :meth:`keys_values` (``rope_k`` the block's)."""
        bsz, rows, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, rows, self.n_heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), *rope_q)
        if isinstance(ctx, torch.Tensor):
            # Two projections instead of one on cat([ctx, x]): the concatenated outputs are 4x
            # narrower than the inputs (GQA), and each call keeps a static row count for float8.
            k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=1)
            v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=1)
            k = self.k_norm(k.view(bsz, -1, self.n_kv_heads, self.head_dim))
            k = apply_rope(k.transpose(1, 2), *rope_k)
            v = v.view(bsz, -1, self.n_kv_heads, self.head_dim).transpose(1, 2)
        else:
            kx, vx = self.keys_values(x, rope_k)
            k, v = torch.cat([ctx[0], kx], dim=2), torch.cat([ctx[1], vx], dim=2)
        o = attention(q, k, v, attn_mask)
        return self.o_proj(o.transpose(1, 2).reshape(bsz, rows, -1))


class DFlash2DecoderLayer(nn.Module):
    """Pre-norm Qwen3-style layer over the block stream; with conv on, each sublayer becomes
    ``x + conv_out(sublayer(conv_in(norm(x))))`` with both kernels predicted from ``norm(x)``."""

    def __init__(self, args: DFlash2Args):
        super().__init__()
        h = args.hidden_size
        self.input_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.self_attn = DFlash2Attention(args)
        self.post_attention_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.mlp = SwiGLU(h, args.intermediate_size)
        self.conv_enabled = args.conv_enabled
        if args.conv_enabled:
            taps, g, b = args.conv_kernel_size, args.conv_group_size, args.block_size
            self.attention_conv = GroupedDynamicConv(h, taps, g, b)
            self.mlp_conv = GroupedDynamicConv(h, taps, g, b)

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, rope_q: Rope, rope_k: Rope, attn_mask
    ) -> torch.Tensor:
        """``x [B, R, H]`` block stream, ``ctx [B, S, H]`` projected target context (or its
        cached keys and values, see :meth:`DFlash2Attention.forward`)."""
        n = self.input_layernorm(x)
        if self.conv_enabled:
            d = self.attention_conv.deltas(n)
            a = self.self_attn(self.attention_conv(n, d, 0), ctx, rope_q, rope_k, attn_mask)
            x = x + self.attention_conv(a, d, 1)
            n = self.post_attention_layernorm(x)
            d = self.mlp_conv.deltas(n)
            return x + self.mlp_conv(self.mlp(self.mlp_conv(n, d, 0)), d, 1)
        x = x + self.self_attn(n, ctx, rope_q, rope_k, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlash2Draft(nn.Module):
    """DFlash2 draft model (plain DFlash when ``conv_enabled`` and ``selector_enabled`` are off).

    Trainable: ``fc``, ``hidden_norm``, ``layers.{i}``, ``norm``, ``candidate_selector``.
    Frozen, non-persistent buffers: ``target_embed`` and ``target_lm_head`` (``[V, H]``, set by
    :meth:`load_frozen_tables`). Compute dtype = ``fc``'s output dtype (bf16 under FSDP2 mixed
    precision).
    """

    def __init__(self, args: DFlash2Args):
        super().__init__()
        if not args.target_layer_ids:
            raise ValueError(
                "DFlash2Args.target_layer_ids is empty: resolve capture_layers() first"
            )
        if args.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {args.block_size}")
        if args.selector_topk_group < 0:
            raise ValueError(f"selector_topk_group must be >= 0 (0: torch.topk), got {args.selector_topk_group}")
        self.args = args
        h = args.hidden_size
        self.fc = nn.Linear(args.fc_in_features, h, bias=False)
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.layers = nn.ModuleDict(
            {str(i): DFlash2DecoderLayer(args) for i in range(args.num_layers)}
        )
        self.norm = RMSNorm(h, args.rms_norm_eps)
        if args.selector_enabled:
            self.candidate_selector = CandidateSelector(h, args.vocab_size, args.selector_rank)
        # Empty placeholders: load_frozen_tables installs the real tables in the target's dtype
        # (no [V, H] fp32 allocation on to_empty).
        self.register_buffer("target_embed", torch.empty(0, h), persistent=False)
        self.register_buffer("target_lm_head", torch.empty(0, h), persistent=False)
        self.selector_alpha = float(args.selector_loss_weight)

    # ----- DraftModel protocol -----

    @torch.no_grad()
    def init_weights(self) -> None:
        """Linears normal(0, 0.02), norms 1; conv = identity, selector successor = 0 (no-ops)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        for module in self.modules():
            if isinstance(module, (GroupedDynamicConv, CandidateSelector)):
                module.reset_parameters()

    @torch.no_grad()
    def load_frozen_tables(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's ``[V, H]`` embedding and lm_head (kept in their dtype)."""
        want = (self.args.vocab_size, self.args.hidden_size)
        for name, w in (("embed", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(w.shape) != want:
                raise ValueError(
                    f"target {name} weight has shape {tuple(w.shape)}, draft expects {want}"
                )
        fc_w = self.fc.weight
        device = fc_w.to_local().device if isinstance(fc_w, DTensor) else fc_w.device
        self.register_buffer(
            "target_embed", embed_weight.detach().to(device).clone(), persistent=False
        )
        self.register_buffer(
            "target_lm_head", lm_head_weight.detach().to(device).clone(), persistent=False
        )

    def set_train_progress(self, step: int, total_steps: int) -> None:
        """Selector weight for optimizer step ``step`` (1-based) of ``total_steps``: 0 for the
        first ``W = round(warmup_ratio * total)`` steps, then a linear ramp reaching the full
        weight after ``round(ramp_ratio * total)`` more steps."""
        a = self.args
        warm = round(a.selector_warmup_ratio * total_steps)
        ramp = round(a.selector_ramp_ratio * total_steps)
        s = step - warm
        if s <= 0:
            self.selector_alpha = 0.0
        elif ramp > 0 and s < ramp:
            self.selector_alpha = a.selector_loss_weight * s / ramp
        else:
            self.selector_alpha = float(a.selector_loss_weight)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos/sin of ``positions [B, L]``, in ``dtype`` (fp32 as HF, fp64 for fp64 models):
        training and decoding rotate with the same angles."""
        a = self.args
        return rope_cos_sin(positions, a.head_dim, a.rope_theta, dtype)

    # ----- forward -----

    def forward(
        self, features: TargetFeatures, *, generator: torch.Generator | None = None
    ) -> DraftOutput:
        a = self.args
        anchors, keep = sample_anchors(
            features.loss_mask, features.valid_lengths, a.num_anchors, a.static_anchors, generator
        )
        return self.forward_with_anchors(features, anchors, keep)

    def forward_with_anchors(
        self, features: TargetFeatures, anchors: torch.Tensor, keep: torch.Tensor
    ) -> DraftOutput:
        """Forward for given ``anchors [B, N]`` / ``keep [B, N]`` (as from ``sample_anchors``)."""
        a = self.args
        hidden, blocks = self.block_hidden(features, anchors, keep)
        return dflash_objective(
            hidden,
            blocks,
            self.target_lm_head,
            chunk_rows=a.ce_chunk_rows,
            logit_scale=a.output_multiplier,
            softcap=a.final_logit_softcapping,
            selector=self.candidate_selector if a.selector_enabled else None,
            selector_top_k=a.selector_top_k,
            selector_topk_group=a.selector_topk_group,
            selector_alpha=self.selector_alpha,
            detach_unary=a.selector_detach_unary,
        )

    def block_hidden(
        self, features: TargetFeatures, anchors: torch.Tensor, keep: torch.Tensor
    ) -> tuple[torch.Tensor, DraftBlocks]:
        """Final-norm hidden states of the block rows ``[B, N * b, H]`` and the block tensors."""
        a = self.args
        if self.target_lm_head.shape[0] == 0:
            raise RuntimeError("DFlash2Draft: call load_frozen_tables() before forward")
        input_ids = features.input_ids
        bsz, seq = input_ids.shape
        b, n = a.block_size, anchors.shape[1]
        rows = n * b
        device = input_ids.device

        aux = features.aux_hidden
        if not isinstance(self.fc.weight, DTensor):
            aux = aux.to(self.fc.weight.dtype)
        # else: fc is an FSDP2 group not yet unsharded; its pre-forward hook casts the input to
        # the mixed-precision param dtype (casting to the sharded fp32 dtype would waste memory).
        ctx = self.hidden_norm(self.fc(aux))
        dtype = ctx.dtype  # the compute dtype (bf16 under FSDP2 mixed precision)
        acc_dtype = torch.promote_types(dtype, torch.float32)
        blocks = build_blocks(
            input_ids,
            features.loss_mask,
            features.valid_lengths,
            anchors,
            keep,
            b,
            a.mask_token_id,
            a.loss_gamma,
            weight_dtype=acc_dtype,
        )
        x = F.embedding(blocks.block_ids, self.target_embed).to(dtype)
        ctx_pos = torch.arange(seq, device=device).expand(bsz, seq)
        rope_q = self.rope(blocks.positions, acc_dtype)
        rope_k = self.rope(torch.cat([ctx_pos, blocks.positions], dim=1), acc_dtype)
        mask_mod = make_mask_mod(anchors, keep, seq, b)
        attn_mask = build_attention_mask(mask_mod, bsz, rows, seq + rows, device, a.attn_backend)
        for layer in self.layers.values():
            x = layer(x, ctx, rope_q, rope_k, attn_mask)
        return self.norm(x), blocks
