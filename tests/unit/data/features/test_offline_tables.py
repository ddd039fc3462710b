"""Offline mode reads the target's two frozen tables alone, and they are the loaded target's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from titan_draft.features.offline import TablesTarget, build_offline_target
from titan_draft.features.target import build_target, load_target, write_random_target
from titan_draft.config import ConfigManager
from titan_draft.protocols import target_spec


def _cfg(*argv):
    return ConfigManager().parse_args(["--data.source", "synthetic:fixed", *argv])


@pytest.mark.parametrize("tied", [False, True])
def test_tables_alone_equal_the_loaded_targets(tmp_path, tied):
    flavor = "debugmodel"
    args = target_spec.random_target_args("qwen3", flavor)
    if tied != args.tie_word_embeddings:  # a flavor of the other kind, registered for this test only
        flavor = f"debugmodel_tied_{tied}"
        target_spec.get_target_spec("qwen3").flavors[flavor] = dataclasses.replace(args, tie_word_embeddings=tied)
    try:
        # sharded files with an index: the tables are found through it
        folder = write_random_target(str(tmp_path / "t"), flavor=flavor, max_shard_bytes=200_000)
    finally:
        target_spec.get_target_spec("qwen3").flavors.pop(f"debugmodel_tied_{tied}", None)
    full = load_target(folder, dtype=torch.float32)
    bundle = build_offline_target(_cfg("--target.path", folder), torch.device("cpu"), torch.float32)
    assert isinstance(bundle.model, TablesTarget) and not list(bundle.model.parameters())
    assert bundle.args == full.args and bundle.source == folder
    assert torch.equal(bundle.model.embed_weight(), full.embed_weight())
    assert torch.equal(bundle.model.lm_head_weight(), full.lm_head_weight())
    assert (bundle.model.lm_head_weight() is bundle.model.embed_weight()) == tied
    with pytest.raises(RuntimeError, match="offline mode"):
        bundle.model.capture(torch.zeros(1, 4, dtype=torch.long), [1], False)


def test_random_flavor_tables_and_eval_loads_the_whole_target():
    cfg = _cfg("--target.flavor", "debugmodel")
    full = build_target(cfg, torch.device("cpu"), torch.float32)
    bundle = build_offline_target(cfg, torch.device("cpu"), torch.float32)
    assert torch.equal(bundle.model.embed_weight(), full.model.embed_weight())
    assert torch.equal(bundle.model.lm_head_weight(), full.model.lm_head_weight())
    with_eval = build_offline_target(_cfg("--target.flavor", "debugmodel", "--eval.enable", "true"),
                                     torch.device("cpu"), torch.float32)
    assert len(with_eval.model.layers) == full.args.num_hidden_layers  # the eval decodes with it
