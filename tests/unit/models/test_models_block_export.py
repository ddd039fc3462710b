"""The export path the block-diffusion drafts share (models/block_diffusion/spec.py): a target wider
than the draft is written and read back, refused when it is not the target trained for; and
config.json's Qwen3 part is the same for every such draft."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
import torch

import models.dflash2  # noqa: F401  (registers the specs)
import models.dspark  # noqa: F401
from models.block_diffusion.args import BlockDiffusionArgs
from titan_draft.protocols.model_spec import get_model_spec

DRAFTS = ("dflash2", "dspark")
QWEN3_HEAD = ["architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
              "max_position_embeddings", "vocab_size", "tie_word_embeddings", "hidden_act", "attention_bias",
              "torch_dtype", "layer_types"]
BACKBONE = [f.name for f in fields(BlockDiffusionArgs)
            if f.name not in ("num_anchors", "loss_gamma", "attn_backend", "static_anchors")]


def _draft(name, target_hidden_size=96):
    spec = get_model_spec(name)
    args = replace(spec.flavors["debugmodel"], vocab_size=97, target_layer_ids=[1, 3], num_target_layers=6,
                   target_hidden_size=target_hidden_size, mask_token_id=5, rope_theta=5e5, rms_norm_eps=1e-5)
    with torch.device("meta"):
        model = spec.model_cls(args)
    sd = {k: torch.zeros(v.shape, dtype=torch.bfloat16) for k, v in model.state_dict().items()}
    return spec, args, sd


@pytest.mark.parametrize("name", DRAFTS)
def test_wider_target_round_trips_and_a_foreign_one_is_refused(name):
    spec, args, sd = _draft(name)
    tensors, config = spec.export_fn(sd, args, {"num_hidden_layers": 6, "vocab_size": 97, "hidden_size": 96})
    assert config["target_hidden_size"] == 96 and list(config)[-1] == "target_hidden_size"
    assert config["num_target_layers"] == 6 and config["num_hidden_layers"] == args.num_layers
    back, _ = spec.from_export_fn(tensors, config)
    assert {k: getattr(back, k) for k in BACKBONE} == {k: getattr(args, k) for k in BACKBONE}
    for target in ({"num_hidden_layers": 6, "vocab_size": 97, "hidden_size": 64},
                   {"num_hidden_layers": 6, "vocab_size": 98, "hidden_size": 96}):
        with pytest.raises(ValueError, match="was not trained for this target"):
            spec.export_fn(sd, args, target)
    with pytest.raises(KeyError, match="target_info lacks 'vocab_size'"):
        spec.export_fn(sd, args, {"num_hidden_layers": 6, "hidden_size": 96})
    with pytest.raises(ValueError, match="target_layer_ids is empty"):
        spec.export_fn(sd, replace(args, target_layer_ids=[]), {"num_hidden_layers": 6, "vocab_size": 97,
                                                                 "hidden_size": 96})


def test_the_qwen3_part_of_config_json_is_shared():
    heads = {}
    for name in DRAFTS:
        spec, args, sd = _draft(name, target_hidden_size=0)
        _, config = spec.export_fn(sd, args, {"num_hidden_layers": 6, "vocab_size": 97, "hidden_size": 64})
        assert "target_hidden_size" not in config  # same width: SGLang reads hidden_size
        heads[name] = {k: v for k, v in config.items() if k in QWEN3_HEAD and k != "architectures"}
        assert list(config)[: len(QWEN3_HEAD)] == QWEN3_HEAD, name
        assert heads[name]["rope_theta"] == 5e5 and heads[name]["layer_types"] == ["full_attention"] * 2
    assert heads["dflash2"] == heads["dspark"]
