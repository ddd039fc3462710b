"""The block-diffusion draft backbone (DFlash family, DSpark): target features -> ``fc`` ->
``hidden_norm`` = the context every layer injects as keys and values; the block stream (the
target's frozen embedding of ``[anchor, MASK...]``) through ``layers``; a final ``norm``. A draft
subclasses :class:`BlockDiffusionDraft` with its layer type and objective;
:class:`~models.block_diffusion.decoder.BlockDecoder` runs the same blocks at decode time over a
cached context.

Parameter FQNs (``fc``, ``hidden_norm``, ``layers.{i}``, ``norm``) are the SGLang serving names.
The target's embedding and lm_head are non-persistent buffers: loaded from the target, never
trained, never in a state dict.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.block_diffusion.args import BlockDiffusionArgs
from models.common.attention import build_attention_mask, resolve_attention_backend
from models.block_diffusion.documents import anchor_documents, row_spans
from models.block_diffusion.layers import DraftBlocks, Rope, anchor_fill, build_blocks, make_mask_mod, sample_anchors
from models.block_diffusion.mask import block_diffusion_block_mask
from models.common.norm import RMSNorm
from models.common.rope import rope_cos_sin
from models.common.tensor_utils import register_frozen_tables
from titan_draft.protocols.features import DraftOutput, TargetFeatures

__all__ = ["BlockDiffusionDraft"]


class BlockDiffusionDraft(nn.Module):
    """``fc``, ``hidden_norm``, ``layers`` (``make_layer(args)`` each), ``norm`` and the frozen
    tables. Compute dtype = ``fc``'s output dtype (bf16 under FSDP2 mixed precision)."""

    def __init__(self, args: BlockDiffusionArgs, make_layer: Callable[[BlockDiffusionArgs], nn.Module]):
        super().__init__()
        if not args.target_layer_ids:
            raise ValueError(f"{type(args).__name__}.target_layer_ids is empty: resolve the capture layers first")
        if args.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {args.block_size}")
        self.args = args
        h = args.hidden_size
        self.fc = nn.Linear(args.fc_in_features, h, bias=False)
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.layers = nn.ModuleDict({str(i): make_layer(args) for i in range(args.num_layers)})
        self.norm = RMSNorm(h, args.rms_norm_eps)
        # Empty placeholders: load_frozen_tables installs the real tables in the target's dtype
        # (no [V, H] fp32 allocation on to_empty).
        self.register_buffer("target_embed", torch.empty(0, h), persistent=False)
        self.register_buffer("target_lm_head", torch.empty(0, h), persistent=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Linears normal(0, 0.02); then every submodule with its own ``reset_parameters`` (norms
        to 1, and a draft's modules that must start as no-ops) resets itself."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        for module in self.modules():
            if module is not self and not isinstance(module, nn.Linear) and hasattr(module, "reset_parameters"):
                module.reset_parameters()

    @torch.no_grad()
    def load_frozen_tables(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's ``[V, H]`` embedding and lm_head (kept in their dtype)."""
        register_frozen_tables(self, embed_weight, lm_head_weight, (self.args.vocab_size, self.args.hidden_size),
                               self.fc.weight)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos/sin of ``positions [B, L]``, in ``dtype`` (fp32 as HF, fp64 for fp64 models):
        training and decoding rotate with the same angles."""
        a = self.args
        return rope_cos_sin(positions, a.head_dim, a.rope_theta, dtype)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """``[B, S, K*H]`` capture-layer outputs -> ``[B, S, H]`` injected context."""
        if not isinstance(self.fc.weight, DTensor):
            aux = aux.to(self.fc.weight.dtype)
        # else: fc is an FSDP2 group not yet unsharded; its pre-forward hook casts the input to
        # the mixed-precision param dtype (casting to the sharded fp32 dtype would waste memory).
        return self.hidden_norm(self.fc(aux))

    def sample_anchors(self, features: TargetFeatures, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(anchors, keep)`` of a training step (``sample_anchors``; in packed rows an anchor's
        next token must be in its document)."""
        a = self.args
        spans = row_spans(features)
        return sample_anchors(features.loss_mask, features.valid_lengths, a.num_anchors, a.static_anchors, generator,
                              ends=None if spans is None else spans[1])

    def forward(self, features: TargetFeatures, *, generator: torch.Generator | None = None) -> DraftOutput:
        """A training step's loss: anchors sampled, then the draft's ``forward_with_anchors``; and
        ``anchor_fill``, the share of the anchor slots the sampler filled (``layers.anchor_fill``)."""
        anchors, keep = self.sample_anchors(features, generator)
        out = self.forward_with_anchors(features, anchors, keep)
        out.metrics["anchor_fill"] = anchor_fill(keep, out.loss_denominator.dtype)
        return out

    def forward_with_anchors(self, features: TargetFeatures, anchors: torch.Tensor, keep: torch.Tensor) -> DraftOutput:
        """The loss for given ``anchors [B, N]`` / ``keep [B, N]`` (as from ``sample_anchors``)."""
        raise NotImplementedError

    def block_hidden(
        self, features: TargetFeatures, anchors: torch.Tensor, keep: torch.Tensor
    ) -> tuple[torch.Tensor, DraftBlocks]:
        """Final-norm hidden states of the block rows ``[B, N * b, H]`` and the block tensors.

        Packed rows (``features.document_ids``): each block sees only its anchor's document
        (``models/block_diffusion/documents.py``), whose context RoPE positions restart at 0."""
        a = self.args
        if self.target_lm_head.shape[0] == 0:
            raise RuntimeError(f"{type(self).__name__}: call load_frozen_tables() before forward")
        input_ids = features.input_ids
        bsz, seq = input_ids.shape
        b, n = a.block_size, anchors.shape[1]
        rows = n * b
        device = input_ids.device
        ctx = self.context(features.aux_hidden)
        dtype = ctx.dtype  # the compute dtype (bf16 under FSDP2 mixed precision)
        acc_dtype = torch.promote_types(dtype, torch.float32)
        docs = anchor_documents(row_spans(features), anchors)
        blocks = build_blocks(input_ids, features.loss_mask, features.valid_lengths, anchors, keep, b,
                              a.mask_token_id, a.loss_gamma, weight_dtype=acc_dtype, docs=docs)
        x = F.embedding(blocks.block_ids, self.target_embed).to(dtype)
        if docs is None:
            ctx_pos = torch.arange(seq, device=device).expand(bsz, seq)
        else:
            ctx_pos = features.position_ids().expand(bsz, seq)
        rope_q = self.rope(blocks.positions, acc_dtype)
        rope_k = self.rope(torch.cat([ctx_pos, blocks.positions], dim=1), acc_dtype)
        doc_starts = None if docs is None else docs.start
        mask_mod = make_mask_mod(anchors, keep, seq, b, doc_starts)
        if resolve_attention_backend(a.attn_backend, device) == "flex":
            # The BlockMask from the anchors' tile structure (models/block_diffusion/mask.py), not
            # create_block_mask's dense [B, Q, KV] evaluation; flex still applies mask_mod inside
            # the partial tiles. sdpa: the dense mask.
            attn_mask = block_diffusion_block_mask(anchors, keep, seq, b, mask_mod=mask_mod, doc_starts=doc_starts)
        else:
            attn_mask = build_attention_mask(mask_mod, bsz, rows, seq + rows, device, a.attn_backend)
        for layer in self.layers.values():
            x = layer(x, ctx, rope_q, rope_k, attn_mask)
        return self.norm(x), blocks
