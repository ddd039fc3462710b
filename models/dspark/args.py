"""DSpark draft architecture, objective settings and flavors."""

from __future__ import annotations

from dataclasses import dataclass

from models.block_diffusion.args import BlockDiffusionArgs
from models.block_diffusion.spec import update_block_args

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
MARKOV_INITS = ("zero_bias", "deepspec")


@dataclass
class DSparkArgs(BlockDiffusionArgs):
    """A DSpark draft: the block-diffusion backbone (:class:`BlockDiffusionArgs`) whose anchor slot
    predicts too (slot k of a block anchored at ``a`` predicts ``x[a + k + 1]``, so a block of
    ``block_size`` slots drafts ``block_size`` tokens), a sequential (Markov) head that adds a
    low-rank bias from the previous token to each slot's logits, and a confidence head that
    predicts each slot's acceptance. Slot k's loss weight is ``exp(-k / loss_gamma)`` times the
    cumulative in-range-and-loss mask along the block."""

    block_size: int = 7
    """Slots per block b: the anchor slot and b - 1 mask slots, each drafting one token, so a round
    drafts b tokens and verifies b + 1 (DeepSpec's recipe: 7)."""
    loss_gamma: float = 4.0
    """Decay of slot k's loss weight ``exp(-k / loss_gamma)`` (DeepSpec's recipe: 4)."""
    markov_rank: int = 256
    """Rank r of the Markov head: ``W1`` embeds the previous token in r dims, ``W2`` maps r dims to
    the vocabulary."""
    markov_head_type: str = "vanilla"
    """'vanilla' (bias ``W2 W1[x_{k-1}]``), 'gated' (``W1[x]`` gated by a sigmoid of
    ``[h_k; W1[x]]``) or 'rnn' (a gated recurrent state carried along the block)."""
    markov_init: str = "zero_bias"
    """How the Markov head starts: 'zero_bias' (``W2 = 0``, ``W1 ~ N(0, 1)``: the draft starts as
    its backbone alone, and only ``W2`` moves at first) or 'deepspec' (``W1``, ``W2`` and the
    gate/joint weights ``~ N(0, 0.02)``, DeepSpec's init: a near-zero bias whose two factors both
    learn from the first step). Read at initialization only."""
    enable_confidence_head: bool = True
    """Train the confidence head (predicted acceptance of each slot) with its BCE term."""
    confidence_head_with_markov: bool = True
    """The confidence head reads ``[h_k; W1[x_{k-1}]]`` (False: ``h_k`` only)."""
    ce_loss_weight: float = 0.1
    """Weight of the cross-entropy against the data token (``soft_labels``: the target's distribution)."""
    soft_labels: bool = False
    """True: the cross-entropy term is against the target's distribution at the slot's position
    (as EAGLE-3 trains) instead of the data token; DSpark's definition is False."""
    l1_loss_weight: float = 0.9
    """Weight of ``sum_v |p_draft - p_target|`` (the target's distribution at the same position)."""
    confidence_loss_weight: float = 1.0
    """Weight of the confidence head's BCE against ``1 - 0.5 * |p_draft - p_target|_1``."""
    ce_chunk_rows: int = 2048
    """Rows per chunk of the lm_head pass (draft and target distributions are never alive for
    more rows than this at once)."""

    def check(self) -> None:
        """One line naming the bad field (called by the model and the args hook)."""
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"model.args.markov_head_type: {self.markov_head_type!r} is not one of "
                             f"{list(MARKOV_HEAD_TYPES)}")
        if self.markov_init not in MARKOV_INITS:
            raise ValueError(f"model.args.markov_init: {self.markov_init!r} is not one of {list(MARKOV_INITS)}")
        if self.markov_rank < 1:
            raise ValueError(f"model.args.markov_rank must be >= 1, got {self.markov_rank}")
        if self.loss_gamma <= 0:
            raise ValueError(f"model.args.loss_gamma must be > 0, got {self.loss_gamma}")
        if self.ce_chunk_rows < 1:
            raise ValueError(f"model.args.ce_chunk_rows must be >= 1, got {self.ce_chunk_rows}")
        for name in ("ce_loss_weight", "l1_loss_weight", "confidence_loss_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.args.{name} must be >= 0, got {getattr(self, name)}")


_debug = DSparkArgs(
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    block_size=4,
    num_anchors=16,
    loss_gamma=4.0,
    markov_rank=16,
)

# DeepSpec's Qwen3-8B recipe: 5 layers on [1, 9, 17, 25, 33] (DFlash's rule, resolved per target),
# blocks of 7 (7 drafted tokens, verified as 8), 512 anchors, decay gamma 4
_qwen3_8b = DSparkArgs(
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=5,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    block_size=7,
    num_anchors=512,
    loss_gamma=4.0,
    markov_rank=256,
)

# SmolLM2-135M-Instruct's width and heads; three layers capture [1, 14, 27] of its 30.
# rope_theta, max positions and eps follow the target (update_block_args).
_smollm2 = DSparkArgs(
    hidden_size=576,
    intermediate_size=1536,
    num_layers=3,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    block_size=7,
    num_anchors=256,
    loss_gamma=4.0,
    markov_rank=128,
)

dspark_flavors: dict[str, DSparkArgs] = {
    "debugmodel": _debug,
    "qwen3_8b": _qwen3_8b,
    "smollm2": _smollm2,
}


def update_dspark_args(args: DSparkArgs, ctx) -> DSparkArgs:
    """The ModelSpec's ``update_args_fn``: the backbone's (target facts, DFlash's capture rule,
    mask token, static anchors), with these flavors as hints."""
    args.check()
    return update_block_args(args, ctx, dspark_flavors)
