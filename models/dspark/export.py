"""Export adapter: DSpark state dict <-> the DSpark draft folder that serving engines load.

The training FQNs are the serving names: the backbone's keys plus ``markov_head.*`` and
``confidence_head.*``; the frozen tables are never exported (the engines take the target's).

Where each engine reads config.json (sources read 2026-12-04):

- SGLang ``--speculative-algorithm DSPARK`` (``python/sglang/srt/models/dspark.py``,
  ``speculative/dspark_components/dspark_config.py``): the model class is
  ``Qwen3DSparkModel``; its heads are built from *top-level* ``markov_rank``,
  ``markov_head_type`` and ``confidence_head_with_markov`` (``dspark_config.*`` wins over
  top-level in the config parser, so none is written: two places could disagree);
  ``block_size``, ``target_layer_ids``, ``mask_token_id`` and ``num_target_layers`` from
  ``dflash_config`` first, then top level. It decodes DeepSpec's slot convention and refuses
  ``speculators_model_type: "dspark"`` folders.
- SpecForge's ``DSparkDraftModel`` (a6b6b023, ``specforge/modeling/draft/{dflash,dspark}.py``)
  reads the heads' four fields, ``mask_token_id``, ``target_layer_ids``, ``projector_type``
  (must be ``dspark`` when set) and ``attention_mode`` (``gqa`` needs fewer KV heads than query
  heads, else ``mha``) from ``dflash_config`` only, and ``block_size`` from the top level.

- vLLM's ``Qwen3DSparkModel`` reads ``mask_token_id`` and ``target_layer_ids`` at the top level
  (its config override lifts them there from ``dflash_config``).

So every field is written at the top level and in ``dflash_config``, with the same values.
DSpark's slot convention (slot k of a block anchored at ``a`` predicts ``x[a + k + 1]``, the
Markov chain starts from the anchor, ``block_size`` drafts a round) is what this draft trains
and what SGLang decodes; SpecForge's reference ``spec_generate`` decodes it one slot late
(models/dspark/proposal.py reproduces both). The config records it under ``titan_draft``.
"""

from __future__ import annotations

import torch

from models.block_diffusion.spec import backbone_config, backbone_fields, backbone_shapes, check_block_export
from models.common.serving import check_serving_tensors
from models.dspark.args import DSparkArgs

ARCHITECTURE = "Qwen3DSparkModel"
# what titan_draft wrote before the serving name was checked against SGLang; still read back
READ_ARCHITECTURES = (ARCHITECTURE, "DSparkDraftModel")
SLOT_CONVENTION = "deepspec: slot k of a block anchored at a predicts x[a + k + 1] (slot 0 included)"
HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")
_BLOCK_FIELDS = ("block_size", "mask_token_id", "target_layer_ids")


def expected_shapes(args: DSparkArgs) -> dict[str, tuple[int, ...]]:
    """Serving key -> shape for these args (target_layer_ids must be resolved)."""
    h, v, r = args.hidden_size, args.vocab_size, args.markov_rank
    shapes = backbone_shapes(args)
    shapes["markov_head.markov_w1.weight"] = (v, r)
    shapes["markov_head.markov_w2.weight"] = (v, r)
    if args.markov_head_type == "gated":
        shapes["markov_head.gate_proj.weight"] = (r, h + r)
        shapes["markov_head.gate_proj.bias"] = (r,)
    elif args.markov_head_type == "rnn":
        shapes["markov_head.joint_proj.weight"] = (3 * r, 2 * r + h)
        shapes["markov_head.joint_proj.bias"] = (3 * r,)
    if args.enable_confidence_head:
        shapes["confidence_head.proj.weight"] = (1, h + (r if args.confidence_head_with_markov else 0))
        shapes["confidence_head.proj.bias"] = (1,)
    return shapes


def check_servable(args: DSparkArgs) -> str:
    """Refuse (one line naming the field) a DSpark a known loader would build wrong or not at
    all; returns SpecForge's ``attention_mode`` for it."""
    heads, kv = args.num_attention_heads, args.num_key_value_heads
    if kv < 1 or heads % kv:
        raise ValueError(f"export: num_key_value_heads {kv} does not divide num_attention_heads {heads} "
                         "(SpecForge's and SGLang's DSpark attention need grouped heads)")
    if not 0 <= args.mask_token_id < args.vocab_size:
        raise ValueError(f"export: mask_token_id {args.mask_token_id} is outside the target vocabulary "
                         f"({args.vocab_size}); SGLang refuses it")
    if args.markov_rank < 1:
        raise ValueError(f"export: markov_rank {args.markov_rank}: SGLang and SpecForge build no Markov head "
                         "below 1, so the trained one would be dropped")
    return "gqa" if kv < heads else "mha"


def export_dspark(state_dict: dict[str, torch.Tensor], args: DSparkArgs, target_info: dict):
    """``(tensors, config.json)`` in the serving contract (module docstring); refuses an
    incomplete draft (a missing head would be served silently as a zero bias or an
    always-confident head) and one a known loader would misread (:func:`check_servable`)."""
    attention_mode = check_servable(args)
    dtype = check_block_export(state_dict, args, target_info, expected_shapes(args))
    heads = {name: getattr(args, name) for name in HEAD_FIELDS}
    block = {"block_size": args.block_size, "mask_token_id": args.mask_token_id,
             "target_layer_ids": list(args.target_layer_ids)}
    config = backbone_config(args, ARCHITECTURE, dtype, {
        "num_target_layers": target_info["num_hidden_layers"],
        **block,
        **heads,  # SGLang builds the heads from these
        "dflash_config": {**block, **heads, "projector_type": "dspark", "attention_mode": attention_mode},
        # read by no engine: how this draft was trained
        "titan_draft": {"slot_convention": SLOT_CONVENTION, "loss_gamma": args.loss_gamma},
    })
    return {k: state_dict[k].detach().contiguous() for k in sorted(state_dict)}, config


def _serving_fields(config: dict) -> dict:
    """The DSpark fields of a serving config.json, from wherever an engine reads them (top level,
    ``dflash_config``, ``dspark_config``); refuses a field whose places disagree, since each
    engine would then build a different draft."""
    places = {"top level": config, "dflash_config": config.get("dflash_config") or {},
              "dspark_config": config.get("dspark_config") or {}}
    out = {}
    for name in _BLOCK_FIELDS + HEAD_FIELDS:
        found = {where: d[name] for where, d in places.items() if name in d}
        if len({repr(v) for v in found.values()}) > 1:
            raise ValueError(f"export config: {name} differs between {found} (engines read different places)")
        if not found:
            raise ValueError(f"export config: missing field {name!r}")
        out[name] = next(iter(found.values()))
    return out


def dspark_from_export(tensors: dict[str, torch.Tensor], config: dict) -> tuple[DSparkArgs, dict[str, torch.Tensor]]:
    """The inverse of :func:`export_dspark` (ours, or any DSpark folder in DeepSpec's slot
    convention). Training-only args keep their defaults; the tensors are checked against the
    shapes."""
    arch = (config.get("architectures") or [None])[0]
    if arch not in READ_ARCHITECTURES:
        raise ValueError(f"export config: architectures {config.get('architectures')!r} is not a DSpark draft")
    if config.get("speculators_model_type") == "dspark":
        raise ValueError("export config: speculators_model_type 'dspark' trains slot k to predict x[a + k] "
                         "(slot 0 unsupervised); this proposer decodes DeepSpec's x[a + k + 1]")
    f = _serving_fields(config)
    try:
        args = DSparkArgs(
            **backbone_fields(config),
            block_size=f["block_size"], mask_token_id=f["mask_token_id"],
            target_layer_ids=list(f["target_layer_ids"]), markov_rank=f["markov_rank"],
            markov_head_type=f["markov_head_type"], enable_confidence_head=bool(f["enable_confidence_head"]),
            confidence_head_with_markov=bool(f["confidence_head_with_markov"]),
            loss_gamma=(config.get("titan_draft") or {}).get("loss_gamma", 4.0),
        )
    except KeyError as e:
        raise ValueError(f"export config: missing field {e.args[0]!r}") from None
    args.check()
    check_serving_tensors(tensors, expected_shapes(args), "export tensors")
    return args, dict(tensors)
