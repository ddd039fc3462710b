"""models/dspark: registry, flavors, serving export and its inverse, FLOPs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import REPO, attention_flops, linear_flops
from models.dspark import DSparkDraft, dspark_flavors, dspark_flops, export_dspark
from models.dspark.export import dspark_from_export, expected_shapes
from titan_draft.protocols import get_model_spec

TARGET = {"num_hidden_layers": 6, "vocab_size": 97, "hidden_size": 64}
DEBUG = replace(dspark_flavors["debugmodel"], vocab_size=97, target_layer_ids=[1, 3], num_target_layers=6,
                mask_token_id=5)


def _state_dict(args, dtype=torch.bfloat16):
    torch.manual_seed(0)
    d = DSparkDraft(args)
    d.init_weights()
    return {k: v.to(dtype) for k, v in d.state_dict().items()}


def test_registry_and_flavors():
    spec = get_model_spec("dspark")
    assert spec.needs_last_hidden and spec.export_fn is export_dspark and spec.flops_fn is dspark_flops
    q = dspark_flavors["qwen3_8b"]
    assert (q.num_layers, q.block_size, q.num_anchors, q.loss_gamma, q.markov_rank) == (5, 7, 512, 4.0, 256)
    assert (q.ce_loss_weight, q.l1_loss_weight, q.confidence_loss_weight) == (0.1, 0.9, 1.0)
    assert spec.float8_skip == ("fc", "markov_head", "confidence_head")
    assert dspark_flavors["smollm2"].hidden_size == 576


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_fqns_are_the_serving_names_and_round_trip(kind):
    args = replace(DEBUG, markov_head_type=kind)
    sd = _state_dict(args)
    assert set(sd) == set(expected_shapes(args))
    tensors, config = export_dspark(sd, args, TARGET)
    # SGLang's DSpark class (its DSPARK model's EntryClass), not SpecForge's training class name
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["torch_dtype"] == "bfloat16"
    for key, value in (("markov_rank", 16), ("markov_head_type", kind), ("enable_confidence_head", True),
                       ("confidence_head_with_markov", True), ("block_size", 4), ("mask_token_id", 5),
                       ("target_layer_ids", [1, 3])):
        assert config[key] == value, key
    assert "x[a + k + 1]" in config["titan_draft"]["slot_convention"]
    extra = {"vanilla": [], "gated": ["gate_proj.bias", "gate_proj.weight"],
             "rnn": ["joint_proj.bias", "joint_proj.weight"]}[kind]
    heads = sorted(k for k in tensors if k.startswith(("markov_head.", "confidence_head.")))
    assert heads == sorted(["confidence_head.proj.bias", "confidence_head.proj.weight", "markov_head.markov_w1.weight",
                            "markov_head.markov_w2.weight"] + [f"markov_head.{e}" for e in extra])
    back_args, back = dspark_from_export(tensors, config)
    for field in ("hidden_size", "num_layers", "block_size", "mask_token_id", "target_layer_ids", "markov_rank",
                  "markov_head_type", "enable_confidence_head", "confidence_head_with_markov", "vocab_size",
                  "loss_gamma", "rope_theta"):
        assert getattr(back_args, field) == getattr(args, field), field
    model = DSparkDraft(back_args)
    model.load_state_dict({k: v.float() for k, v in back.items()}, strict=True)
    for k in sd:
        assert torch.equal(model.state_dict()[k].to(torch.bfloat16), sd[k]), k


def test_from_export_reads_nested_fields():
    sd = _state_dict(DEBUG)
    tensors, config = export_dspark(sd, DEBUG, TARGET)
    fields = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
              "block_size", "mask_token_id", "target_layer_ids")
    nested = {k: config.pop(k) for k in fields}
    del config["dflash_config"]
    config["dspark_config"] = nested
    args, _ = dspark_from_export(tensors, config)
    assert args.markov_rank == 16 and args.target_layer_ids == [1, 3]
    del config["dspark_config"]["markov_rank"]
    with pytest.raises(ValueError, match="missing field 'markov_rank'"):
        dspark_from_export(tensors, config)


def test_export_refuses_incomplete_or_foreign_drafts():
    sd = _state_dict(DEBUG)
    no_conf = {k: v for k, v in sd.items() if not k.startswith("confidence_head.")}
    with pytest.raises(KeyError, match=r"missing keys \['confidence_head.proj.bias', 'confidence_head.proj.weight'\]"):
        export_dspark(no_conf, DEBUG, TARGET)
    with pytest.raises(KeyError, match="missing keys \\['markov_head.markov_w2.weight'\\]"):
        export_dspark({k: v for k, v in sd.items() if k != "markov_head.markov_w2.weight"}, DEBUG, TARGET)
    with pytest.raises(KeyError, match="frozen target tables"):
        export_dspark({**sd, "target_lm_head": torch.zeros(1)}, DEBUG, TARGET)
    with pytest.raises(KeyError, match="wrapper prefixes"):
        export_dspark({"layers.0._orig_mod.x" if k == "norm.weight" else k: v for k, v in sd.items()}, DEBUG, TARGET)
    bad = dict(sd)
    bad["markov_head.markov_w1.weight"] = torch.zeros(97, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="markov_head.markov_w1.weight: \\(97, 8\\) != \\(97, 16\\)"):
        export_dspark(bad, DEBUG, TARGET)
    with pytest.raises(ValueError, match="mixed dtypes"):
        export_dspark({**sd, "norm.weight": sd["norm.weight"].float()}, DEBUG, TARGET)
    with pytest.raises(ValueError, match="not trained for this target"):
        export_dspark(sd, DEBUG, {**TARGET, "vocab_size": 1000})
    with pytest.raises(ValueError, match="out of range"):
        export_dspark(sd, replace(DEBUG, target_layer_ids=[1, 7]), TARGET)
    # the disabled head is not exported, and not expected back
    off = replace(DEBUG, enable_confidence_head=False)
    tensors, config = export_dspark(_state_dict(off), off, TARGET)
    assert not any(k.startswith("confidence_head") for k in tensors) and config["enable_confidence_head"] is False
    _, config = export_dspark(sd, DEBUG, TARGET)
    with pytest.raises(ValueError, match="is not a DSpark draft"):
        dspark_from_export(sd, {**config, "architectures": ["DFlashDraftModel"]})
    with pytest.raises(KeyError, match="missing keys"):
        dspark_from_export(no_conf, config)


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_flops_count_every_trainable_linear(kind):
    """6 * rows * in * out of every trainable Linear found on the module (plus the frozen tables and
    attention, counted by their formulas): a Linear the count forgets fails here."""
    args = replace(DEBUG, markov_head_type=kind)
    rows = args.num_anchors * args.block_size
    model = DSparkDraft(args)
    # the teacher head once per position the rows read: fewer positions than rows, then more
    for bsz, seq in ((3, rows // 2), (2, 3 * rows)):
        tables = (4 * rows + 2 * min(rows, seq)) * args.hidden_size * args.vocab_size
        want = linear_flops(model, seq, rows) + tables + attention_flops(args, seq, rows)
        assert dspark_flops(args, bsz, seq) == pytest.approx(bsz * want)


@pytest.mark.parametrize("name", ["dspark_debug", "dspark_qwen3_8b", "dspark_smollm2"])
def test_configs_load(name):
    """Every DSpark job file parses (unknown keys are errors) and names a DSpark flavor."""
    import os

    from titan_draft.config import ConfigManager

    path = os.path.join(REPO, "train_configs", f"{name}.toml")
    cfg = ConfigManager().parse_args(["--job.config_file", path])
    assert cfg.model.name == "dspark" and cfg.model.flavor in dspark_flavors
    assert cfg.training.static_shapes


def test_qwen3_8b_job_is_deepspecs_recipe():
    """The optimizer and schedule of DeepSpec's dspark_qwen3_8b: AdamW lr 6e-4, torch's betas
    (0.9, 0.999), no weight decay, 4 % linear warm-up then cosine to 0, clip 1.0; blocks of 7,
    512 anchors, decay 4 (the flavor)."""
    import os

    from titan_draft.config import ConfigManager

    cfg = ConfigManager().parse_args(["--job.config_file", os.path.join(REPO, "train_configs", "dspark_qwen3_8b.toml")])
    o, s = cfg.optimizer, cfg.lr_scheduler
    assert (o.name, o.lr, o.beta1, o.beta2, o.weight_decay) == ("AdamW", 6e-4, 0.9, 0.999, 0.0)
    assert (s.warmup_ratio, s.decay_type, s.min_lr_factor, cfg.training.max_norm) == (0.04, "cosine", 0.0, 1.0)
    assert cfg.model.flavor == "qwen3_8b" and not cfg.model.args


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_markov_init_deepspec(kind):
    """markov_init='deepspec' starts every Markov weight at N(0, 0.02) and its biases at 0 (the
    backbone's pass over the modules, which resets an nn.Embedding to N(0, 1), does not undo it);
    the default starts W2 at 0 and W1 at N(0, 1). A bad name is one line naming the field."""
    torch.manual_seed(0)
    d = DSparkDraft(replace(DEBUG, markov_head_type=kind, markov_init="deepspec", markov_rank=64))
    d.init_weights()
    head = d.markov_head
    weights = [head.markov_w1.weight, head.markov_w2.weight]
    biases = []
    for proj in ("gate_proj", "joint_proj"):
        if hasattr(head, proj):
            weights.append(getattr(head, proj).weight)
            biases.append(getattr(head, proj).bias)
    for w in weights:
        assert float(w.std()) == pytest.approx(0.02, rel=0.1) and abs(float(w.mean())) < 2e-3
    assert all(float(b.abs().max()) == 0 for b in biases)
    torch.manual_seed(0)
    zero = DSparkDraft(replace(DEBUG, markov_head_type=kind, markov_rank=64))
    zero.init_weights()
    assert zero.markov_head.markov_w2.weight.abs().max() == 0  # a fresh draft drafts as its backbone alone
    for proj in ("gate_proj", "joint_proj"):
        if hasattr(zero.markov_head, proj):
            assert getattr(zero.markov_head, proj).bias.abs().max() == 0
    assert zero.confidence_head.proj.bias.abs().max() == 0 and d.confidence_head.proj.bias.abs().max() == 0
    assert float(zero.markov_head.markov_w1.weight.std()) == pytest.approx(1.0, rel=0.1)
    with pytest.raises(ValueError, match="model.args.markov_init: 'xavier' is not one of"):
        DSparkDraft(replace(DEBUG, markov_init="xavier"))
