"""EAGLE-3 draft architecture, training-time-test settings and flavors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from models.common.args import DecoderArgs


@dataclass
class Eagle3Args(DecoderArgs):
    """One decoder layer on the fused target features, unrolled ``ttt_steps`` times in training.

    ``hidden_size`` must equal the target's: the layer reads the target's frozen embedding beside
    the fused features. ``vocab_size`` is the target's; the draft predicts over its own
    ``draft_vocab_size`` most frequent training tokens (``d2t`` / ``t2d``).
    """

    ttt_steps: int = 7
    """Training-time-test unroll K: step j feeds the draft's own output of step j - 1."""
    step_decay: float = 0.8
    """Loss of step j is weighted step_decay ** j."""
    draft_vocab_size: int = 32000
    """Tokens the draft's lm_head predicts (the most frequent loss-masked training tokens)."""
    train_lm_head: bool = True
    """False: ``lm_head`` stays the target's own head rows of the draft vocabulary, frozen, as the
    DFlash-family drafts read the target's head unchanged: an ablation of what training the head
    adds (the export is the same shape and serves the same way)."""
    soft_labels: bool = True
    """True: each step's cross-entropy is against the target's next-token distribution over the
    draft vocabulary (EAGLE-3's definition). False: against a one-hot of the target's argmax, the
    label a block drafter trains on with greedy data: an ablation of what the distribution adds."""
    draft_vocab_file: str = ""
    """The d2t / t2d file (models/eagle3/vocab.py); empty: counted from the training data before
    training and written to job.dump_folder/draft_vocab.safetensors."""
    target_layer_ids: list[int] = field(default_factory=list)
    """Capture layer ids (SGLang convention); empty until resolved: [1, L/2 - 1, L - 4]."""
    num_target_layers: int = 0
    """Number of target layers; 0 until resolved."""
    target_hidden_size: int = 0
    """Target width feeding fc (0: same as hidden_size)."""
    attn_backend: str = "auto"
    """'auto' (flex on CUDA, sdpa on CPU), 'flex' or 'sdpa'."""
    ttt_attention: str = "diagonal"
    """How training computes step i's attention: 'diagonal' (step 0's keys causally, merged with
    the later steps' keys at the query's own position; one traced graph for all steps after the
    first; models/eagle3/ttt_attention.py) or 'concat' (all (i + 1) * S keys of the steps so far
    under one mask; the same result, the layer traced once per step). On an H200 at the Qwen3-8B
    shape diagonal took 124 ms a step against 128.7 and compiled faster, for 1.2 GiB more peak
    memory (docs/benchmarks/2026-12-04-eagle3-diagonal-ttt.md): 'concat' where memory is tight."""

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * (self.target_hidden_size or self.hidden_size)


TTT_ATTENTION_FORMS = ("concat", "diagonal")


def eagle3_capture_layers(num_target_layers: int) -> list[int]:
    """EAGLE-3's capture ids ``[1, L/2 - 1, L - 4]`` (SGLang convention, the outputs of those
    layers = the inputs of layers 2, L/2, L - 3): Qwen3-8B -> [1, 17, 32], Llama-3.1-8B ->
    [1, 15, 28], SmolLM2-135M -> [1, 14, 26]."""
    L = num_target_layers
    return [1, L // 2 - 1, L - 4]


_debug = Eagle3Args(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
    ttt_steps=3,
    draft_vocab_size=512,
)

# the SpecForge Qwen3-8B anchor's shape: width and heads of the target, TTT 7, 32k vocabulary
_qwen3_8b = Eagle3Args(
    hidden_size=4096,
    intermediate_size=12288,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    ttt_steps=7,
    draft_vocab_size=32000,
)

_smollm2 = Eagle3Args(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    ttt_steps=7,
    draft_vocab_size=16384,
)

eagle3_flavors: dict[str, Eagle3Args] = {
    "debugmodel": _debug,
    "qwen3_8b": _qwen3_8b,
    "smollm2": _smollm2,
}


def update_eagle3_args(args: Eagle3Args, ctx) -> Eagle3Args:
    """The ModelSpec's ``update_args_fn``: target facts and capture layers (the draft
    vocabulary is counted later, by ``prepare_fn``, when the data pipeline exists)."""
    t = ctx.target
    if args.hidden_size != t.hidden_size:
        fits = sorted(n for n, f in eagle3_flavors.items() if f.hidden_size == t.hidden_size)
        raise ValueError(f"model: draft hidden_size {args.hidden_size} != target hidden_size {t.hidden_size} (the "
                         f"draft reads the target's embedding); flavors of this width: {fits}")
    layer_ids = list(ctx.job.target.capture_layers) or eagle3_capture_layers(t.num_hidden_layers)
    bad = [i for i in layer_ids if not 0 <= i < t.num_hidden_layers]
    if bad:
        raise ValueError(f"target.capture_layers: ids {bad} are outside the target's {t.num_hidden_layers} layers")
    if args.draft_vocab_size > t.vocab_size:
        raise ValueError(f"model.args.draft_vocab_size {args.draft_vocab_size} exceeds the target's "
                         f"{t.vocab_size} tokens")
    if args.ttt_steps < 1:
        raise ValueError(f"model.args.ttt_steps must be >= 1, got {args.ttt_steps}")
    if args.ttt_attention not in TTT_ATTENTION_FORMS:
        raise ValueError(f"model.args.ttt_attention must be one of {TTT_ATTENTION_FORMS}, got {args.ttt_attention!r}")
    follow = {k: getattr(t, k) for k in ("rope_theta", "max_position_embeddings", "rms_norm_eps")
              if k not in ctx.overrides}
    return replace(args, **follow, target_layer_ids=layer_ids, num_target_layers=t.num_hidden_layers,
                   vocab_size=t.vocab_size, target_hidden_size=t.hidden_size)
