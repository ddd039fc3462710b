"""DSpark draft: the block-diffusion backbone (models/block_diffusion/draft.py, DFlash's layers) with
the anchor slot predicting, a Markov head and a confidence head (heads.py), trained by
objective.py.

Parameter FQNs are the SGLang DSpark serving names: the backbone's ``fc``, ``hidden_norm``,
``layers.{i}``, ``norm`` plus ``markov_head.*`` and ``confidence_head.*`` (export.py).
"""

from __future__ import annotations

import torch

from models.block_diffusion.documents import anchor_documents, row_spans
from models.block_diffusion.layers import BlockDecoderLayer
from models.block_diffusion.draft import BlockDiffusionDraft
from models.dspark.args import DSparkArgs
from models.dspark.heads import ConfidenceHead, MarkovHead
from models.dspark.objective import dspark_objective, early_slot_targets
from titan_draft.protocols.features import DraftOutput, TargetFeatures


class DSparkDraft(BlockDiffusionDraft):
    """Trainable: ``fc``, ``hidden_norm``, ``layers.{i}``, ``norm``, ``markov_head``,
    ``confidence_head`` (when enabled). Needs the target's final-norm hidden states
    (``TargetFeatures.last_hidden``) for the distillation terms."""

    def __init__(self, args: DSparkArgs):
        args.check()
        super().__init__(args, BlockDecoderLayer)
        h, r = args.hidden_size, args.markov_rank
        self.markov_head = MarkovHead(h, args.vocab_size, r, args.markov_head_type, args.markov_init)
        self.confidence_head = (ConfidenceHead(h, r, args.confidence_head_with_markov)
                                if args.enable_confidence_head else None)

    @torch.no_grad()
    def init_weights(self) -> None:
        super().init_weights()
        # the backbone's pass resets markov_w1 (an nn.Embedding: N(0, 1)) after the head itself,
        # so the head's own init (markov_init) has the last word here
        self.markov_head.reset_parameters()

    def set_train_progress(self, step: int, total_steps: int) -> None:
        pass

    def forward_with_anchors(self, features: TargetFeatures, anchors: torch.Tensor, keep: torch.Tensor) -> DraftOutput:
        """Forward for given ``anchors [B, N]`` / ``keep [B, N]`` (as from ``sample_anchors``)."""
        if features.last_hidden is None:
            raise ValueError("DSpark needs the target's final-norm hidden states (needs_last_hidden)")
        docs = anchor_documents(row_spans(features), anchors)
        early = early_slot_targets(self, features.input_ids, features.loss_mask, features.valid_lengths,
                                   anchors, keep, docs)
        hidden, blocks = self.block_hidden(features, anchors, keep)
        return dspark_objective(self, hidden, blocks, features.last_hidden, features.input_ids,
                                features.loss_mask, features.valid_lengths, early)
