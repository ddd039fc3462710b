"""DFlash2 draft: the block-diffusion backbone (models/block_diffusion/draft.py) + grouped dynamic
convolutions + candidate selector; plain DFlash with both off.

Parameter FQNs are exactly the serving names of SGLang's ``DFlash2DraftModel`` /
``DFlashDraftModel`` (see export.py).
"""

from __future__ import annotations

import torch

from models.block_diffusion.layers import BlockDecoderLayer, Rope
from models.block_diffusion.draft import BlockDiffusionDraft
from models.dflash2.args import DFlash2Args
from models.dflash2.conv import GroupedDynamicConv
from models.dflash2.objective import dflash_objective
from models.dflash2.selector import CandidateSelector
from titan_draft.protocols.features import DraftOutput, TargetFeatures


class DFlash2DecoderLayer(BlockDecoderLayer):
    """The backbone's layer; with conv on, each sublayer becomes
    ``x + conv_out(sublayer(conv_in(norm(x))))`` with both kernels predicted from ``norm(x)``."""

    def __init__(self, args: DFlash2Args):
        super().__init__(args)
        self.conv_enabled = args.conv_enabled
        if args.conv_enabled:
            h, taps, g, b = args.hidden_size, args.conv_kernel_size, args.conv_group_size, args.block_size
            self.attention_conv = GroupedDynamicConv(h, taps, g, b)
            self.mlp_conv = GroupedDynamicConv(h, taps, g, b)

    def forward(self, x: torch.Tensor, ctx, rope_q: Rope, rope_k: Rope, attn_mask) -> torch.Tensor:
        if not self.conv_enabled:
            return super().forward(x, ctx, rope_q, rope_k, attn_mask)
        n = self.input_layernorm(x)
        d = self.attention_conv.deltas(n)
        a = self.self_attn(self.attention_conv(n, d, 0), ctx, rope_q, rope_k, attn_mask)
        x = x + self.attention_conv(a, d, 1)
        n = self.post_attention_layernorm(x)
        d = self.mlp_conv.deltas(n)
        return x + self.mlp_conv(self.mlp(self.mlp_conv(n, d, 0)), d, 1)


class DFlash2Draft(BlockDiffusionDraft):
    """DFlash2 draft model (plain DFlash when ``conv_enabled`` and ``selector_enabled`` are off).

    Trainable: ``fc``, ``hidden_norm``, ``layers.{i}``, ``norm``, ``candidate_selector``; the
    convolutions start as the identity and the selector's successor codebook at zero, so an
    initialized DFlash2 computes what plain DFlash does.
    """

    def __init__(self, args: DFlash2Args):
        if args.selector_topk_group < 0:
            raise ValueError(f"selector_topk_group must be >= 0 (0: torch.topk), got {args.selector_topk_group}")
        super().__init__(args, DFlash2DecoderLayer)
        if args.selector_enabled:
            self.candidate_selector = CandidateSelector(args.hidden_size, args.vocab_size, args.selector_rank)
        self.selector_alpha = float(args.selector_loss_weight)

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

    def forward_with_anchors(self, features: TargetFeatures, anchors: torch.Tensor, keep: torch.Tensor) -> DraftOutput:
        """Forward for given ``anchors [B, N]`` / ``keep [B, N]`` (as from ``sample_anchors``)."""
        a = self.args
        if a.soft_labels and features.last_hidden is None:
            raise ValueError("DFlash2 with soft_labels needs the target's final-norm hidden states (needs_last_hidden)")
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
            teacher_hidden=features.last_hidden if a.soft_labels else None,
        )
