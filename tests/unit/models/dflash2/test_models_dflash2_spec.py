"""models/dflash2: serving export, capture-layer rule, FLOPs, registry and FQNs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from helpers import attention_flops, linear_flops
from models.dflash2 import (
    DFlash2Draft,
    capture_layers,
    dflash2_flavors,
    dflash2_flops,
    export_dflash2,
)
from models.dflash2.export import expected_shapes
from titan_draft.protocols.model_spec import get_model_spec

DEBUG = replace(dflash2_flavors["debugmodel"], target_layer_ids=[1, 3], num_target_layers=6)
TARGET = {"num_hidden_layers": 6, "vocab_size": 151936, "hidden_size": 64}


def _state_dict(args, dtype=torch.bfloat16):
    with torch.device("meta"):
        model = DFlash2Draft(args)
    # shapes and names only: meta tensors -> real zeros of the export dtype
    return {k: torch.zeros(v.shape, dtype=dtype) for k, v in model.state_dict().items()}


def test_fqns_are_the_serving_names():
    sd = _state_dict(DEBUG)
    layer0 = {k for k in sd if k.startswith("layers.0.")}
    assert layer0 == {
        "layers.0.input_layernorm.weight",
        "layers.0.post_attention_layernorm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.self_attn.v_proj.weight",
        "layers.0.self_attn.o_proj.weight",
        "layers.0.self_attn.q_norm.weight",
        "layers.0.self_attn.k_norm.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "layers.0.attention_conv.base_kernel",
        "layers.0.attention_conv.kernel_projection.weight",
        "layers.0.mlp_conv.base_kernel",
        "layers.0.mlp_conv.kernel_projection.weight",
    }
    top = {k for k in sd if not k.startswith("layers.")}
    assert top == {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "candidate_selector.hidden_projection.weight",
        "candidate_selector.predecessor_codebook",
        "candidate_selector.successor_codebook",
    }
    h, v = 64, 151936
    assert sd["fc.weight"].shape == (h, 2 * h)
    assert sd["layers.1.self_attn.k_norm.weight"].shape == (16,)
    assert sd["layers.1.mlp_conv.base_kernel"].shape == (2, 2, h)
    assert sd["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * h // 16, h)
    assert sd["candidate_selector.successor_codebook"].shape == (v, 16)
    assert sd["candidate_selector.hidden_projection.weight"].shape == (16, h)


def test_export_dflash2_names_shapes_dtypes_config():
    sd = _state_dict(DEBUG)
    tensors, config = export_dflash2(sd, DEBUG, TARGET)
    assert set(tensors) == set(sd) == set(expected_shapes(DEBUG))
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors.values())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["model_type"] == "qwen3" and config["torch_dtype"] == "bfloat16"
    assert config["num_hidden_layers"] == 2 and config["layer_types"] == ["full_attention"] * 2
    assert config["num_target_layers"] == 6 and config["block_size"] == 8
    assert config["tie_word_embeddings"] is False and config["hidden_act"] == "silu"
    assert config["attention_bias"] is False and config["vocab_size"] == 151936
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
    ):
        assert config[key] == getattr(DEBUG, key), key
    assert config["dflash_config"] == {
        "mask_token_id": 151669,
        "target_layer_ids": [1, 3],
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 16,
        "selector_top_k": 8,
    }
    args = replace(DEBUG, output_multiplier=0.5, final_logit_softcapping=30.0)
    _, config = export_dflash2(sd, args, TARGET)
    assert config["dflash_config"]["output_multiplier"] == 0.5
    assert config["dflash_config"]["final_logit_softcapping"] == 30.0


def test_export_plain_dflash():
    args = replace(
        dflash2_flavors["dflash_debugmodel"], target_layer_ids=[1, 3], num_target_layers=6
    )
    sd = _state_dict(args)
    assert not any("conv" in k or "selector" in k for k in sd)
    tensors, config = export_dflash2(sd, args, TARGET)
    assert set(tensors) == set(sd)
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {"mask_token_id": 151669, "target_layer_ids": [1, 3]}


def test_export_errors():
    sd = _state_dict(DEBUG)
    missing = dict(sd)
    del missing["layers.1.mlp_conv.base_kernel"]
    with pytest.raises(KeyError, match=r"missing keys \['layers\.1\.mlp_conv\.base_kernel'\]"):
        export_dflash2(missing, DEBUG, TARGET)
    with pytest.raises(KeyError, match=r"unexpected keys \['layers\.2\.norm\.weight'\]"):
        export_dflash2({**sd, "layers.2.norm.weight": torch.zeros(1)}, DEBUG, TARGET)
    with pytest.raises(KeyError, match="frozen target tables.*target_lm_head"):
        export_dflash2({**sd, "target_lm_head": torch.zeros(1)}, DEBUG, TARGET)
    with pytest.raises(KeyError, match="frozen target tables.*embed_tokens"):
        export_dflash2({**sd, "embed_tokens.weight": torch.zeros(1)}, DEBUG, TARGET)
    wrapped = {k.replace("layers.0.", "layers.0._orig_mod."): v for k, v in sd.items()}
    with pytest.raises(KeyError, match="_orig_mod"):
        export_dflash2(wrapped, DEBUG, TARGET)
    wrapped = {
        k.replace("layers.0.", "layers.0._checkpoint_wrapped_module."): v for k, v in sd.items()
    }
    with pytest.raises(KeyError, match="_checkpoint_wrapped_module"):
        export_dflash2(wrapped, DEBUG, TARGET)
    bad = {**sd, "fc.weight": torch.zeros(64, 3 * 64, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match=r"fc\.weight: \(64, 192\) != \(64, 128\)"):
        export_dflash2(bad, DEBUG, TARGET)
    with pytest.raises(ValueError, match="vocab_size"):
        export_dflash2(sd, DEBUG, {**TARGET, "vocab_size": 1000})
    with pytest.raises(ValueError, match="target_layer_ids"):
        export_dflash2(sd, replace(DEBUG, target_layer_ids=[1, 7]), TARGET)


def test_capture_layers_rule():
    a = dflash2_flavors["dflash_debugmodel"]
    assert capture_layers(a, 36) == [1, 33]  # n = 2: 1 and L - 3
    assert capture_layers(replace(a, num_layers=4), 36) == [1, 12, 22, 33]  # rounded
    assert capture_layers(replace(a, num_layers=5), 36) == [1, 9, 17, 25, 33]
    assert capture_layers(replace(a, num_layers=1), 36) == [18]
    assert capture_layers(replace(a, num_layers=3), 6) == [1, 2, 3]
    assert capture_layers(dflash2_flavors["qwen3_8b"], 36) == [1, 9, 17, 25, 33]
    assert capture_layers(replace(a, target_layer_ids=[0, 4]), 6) == [0, 4]
    with pytest.raises(ValueError, match="out of range"):
        capture_layers(replace(a, target_layer_ids=[0, 6]), 6)


@pytest.mark.parametrize("flavor", ["debugmodel", "dflash_debugmodel"])
def test_flops_counts_every_trainable_linear(flavor):
    args = replace(dflash2_flavors[flavor], target_layer_ids=[1, 3])
    seq, bsz = 256, 3
    with torch.device("meta"):
        model = DFlash2Draft(args)
    rows = args.num_anchors * args.block_size
    lm_head = 4 * args.num_anchors * (args.block_size - 1) * args.hidden_size * args.vocab_size
    want = linear_flops(model, seq, rows) + lm_head + attention_flops(args, seq, rows)
    assert dflash2_flops(args, bsz, seq) == pytest.approx(bsz * want, rel=1e-12)


def test_registry_and_flavors():
    spec = get_model_spec("dflash2")
    assert spec.model_cls is DFlash2Draft and spec.needs_last_hidden is False
    assert spec.export_fn is export_dflash2 and spec.flops_fn is dflash2_flops
    assert spec.capture_layers_fn(replace(dflash2_flavors["debugmodel"], target_layer_ids=[3, 1])) == [3, 1]
    assert callable(spec.parallelize_fn) and callable(spec.update_args_fn)
    assert set(spec.flavors) == {"debugmodel", "qwen3_8b", "dflash_debugmodel", "dflash_qwen3_8b", "smollm2",
                                 "dflash_smollm2"}
    for name in ("smollm2", "dflash_smollm2"):  # SmolLM2-135M's shape; capture [1, 14, 27] of 30
        f = spec.flavors[name]
        assert (f.hidden_size, f.num_attention_heads, f.num_key_value_heads, f.head_dim) == (576, 9, 3, 64)
        assert f.block_size == 16 and capture_layers(f, 30) == [1, 14, 27]
    q = spec.flavors["qwen3_8b"]
    assert (q.num_layers, q.hidden_size, q.block_size, q.num_anchors, q.loss_gamma) == (
        5,
        4096,
        16,
        512,
        7.0,
    )
    assert (q.selector_rank, q.selector_top_k, q.conv_kernel_size, q.conv_group_size) == (
        256,
        16,
        2,
        16,
    )
    d = spec.flavors["dflash_qwen3_8b"]
    assert not d.conv_enabled and not d.selector_enabled
    # the production flavors follow the rule per target: Qwen3-8B (36 layers), Llama-3.1-8B (32)
    for flavor in (q, d):
        assert capture_layers(flavor, 36) == [1, 9, 17, 25, 33]
        assert capture_layers(flavor, 32) == [1, 8, 15, 22, 29]
    with pytest.raises(ValueError, match="target_layer_ids"):
        DFlash2Draft(dflash2_flavors["debugmodel"])
