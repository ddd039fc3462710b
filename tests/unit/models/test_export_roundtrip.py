"""The exported folder is the draft: loading it back reproduces the trained draft's outputs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.dflash2 import DFlash2Draft, dflash2_flavors
from titan_draft.checkpoint.export import export_draft, load_export
from titan_draft.protocols import TargetFeatures, get_model_spec

V, H = 151936, 64


def _args(flavor):
    return replace(
        dflash2_flavors[flavor], target_layer_ids=[1, 3], num_target_layers=6, vocab_size=V,
        target_hidden_size=H, static_anchors=True,
    )


def _draft(args, tables, seed):
    torch.manual_seed(seed)
    model = DFlash2Draft(args)
    model.init_weights()
    with torch.no_grad():  # move every weight off its init (zero conv/selector parts included)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.load_frozen_tables(*tables)
    return model


def _features(seed=0, b=2, s=48):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 5000, (b, s), generator=g)
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[:, 10:] = True
    return TargetFeatures(
        input_ids=ids, loss_mask=mask, valid_lengths=torch.full((b,), s),
        aux_hidden=torch.randn(b, s, 2 * H, generator=g),
    )


@pytest.mark.parametrize("flavor", ["debugmodel", "dflash_debugmodel"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_load_reproduces_outputs(tmp_path, flavor, dtype):
    spec = get_model_spec("dflash2")
    args = _args(flavor)
    tables = (0.1 * torch.randn(V, H), 0.1 * torch.randn(V, H))
    trained = _draft(args, tables, seed=1)
    target_info = {"num_hidden_layers": 6, "vocab_size": V, "hidden_size": H}
    export_draft(trained, spec.export_fn, args, target_info, str(tmp_path), dtype=dtype, is_rank0=True)

    tensors, config = load_export(str(tmp_path))
    assert config["dflash_config"]["target_layer_ids"] == [1, 3]
    assert config["block_size"] == args.block_size and config["hidden_size"] == H
    # a fresh draft (different init) with the exported weights loaded strictly
    served = _draft(args, tables, seed=2)
    served.load_state_dict({k: t.float() for k, t in tensors.items()}, strict=True)
    if dtype == "bfloat16":  # the reference is the trained draft rounded like the export
        with torch.no_grad():
            for p in trained.parameters():
                p.copy_(p.to(torch.bfloat16).float())

    feats = _features()
    out_a = trained(feats, generator=torch.Generator().manual_seed(5))
    out_b = served(feats, generator=torch.Generator().manual_seed(5))
    assert torch.equal(out_a.loss_sum, out_b.loss_sum)
    for name, (num, den) in out_a.metrics.items():
        assert torch.equal(num, out_b.metrics[name][0]) and torch.equal(den, out_b.metrics[name][1])
    # and it really is the trained weights that came back, not the fresh init
    fresh = _draft(args, tables, seed=2)(feats, generator=torch.Generator().manual_seed(5))
    assert not torch.equal(fresh.loss_sum, out_a.loss_sum)
