"""The synthetic source (fixed, varmask, varlen and the recorded-length modes) and the synthetic
target that scripts/benchmark.py runs on."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from titan_draft.features.synthetic import build_synthetic_target
from titan_draft.features.target import build_target
from titan_draft.config import ConfigManager
from titan_draft.data.pipeline import build_dataloader
from titan_draft.data.sources.synthetic import SyntheticSourceNode, synthetic_sample
from titan_draft.data.tokenizer import build_tokenizer
from helpers import REPO


# ---- synthetic source ----


def test_recorded_length_modes_follow_the_recorded_lengths(tmp_path):
    """first_exchange / conversation rows take their lengths from the recorded table: re-recorded
    from ShareGPT with scripts/length_histogram.py, the first rows match the packaged file, and
    the rows' padded fill at a max_length is the table's (truncation included)."""
    from titan_draft.data.sources.synthetic import recorded_lengths

    spec = importlib.util.spec_from_file_location("length_histogram", os.path.join(REPO, "scripts",
                                                                                   "length_histogram.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "first.json"
    script.main(["--cut", "first_exchange", "--rows", "40", "--out", str(out)])
    assert [tuple(p) for p in json.loads(out.read_text())["lengths"]] == recorded_lengths("first_exchange")[:40]
    for mode in ("first_exchange", "conversation"):
        table = recorded_lengths(mode)
        assert len(table) == 3000 and all(0 < loss <= n for n, loss in table)
        rows = [synthetic_sample(mode, 1024, seed=1, row=r) for r in range(1500)]
        fill = sum(len(ids) for ids, _ in rows) / (1024 * len(rows))
        want = sum(min(n, 1024) for n, _ in table) / (1024 * len(table))
        assert fill == pytest.approx(want, abs=0.03)
        for (ids, mask) in rows[:50]:
            prompt = mask.index(True)
            assert all(mask[prompt:]) and not any(mask[:prompt]) and len(ids) - prompt >= 2


@pytest.mark.parametrize("mode", ["fixed", "varmask", "varlen"])
def test_synthetic_sample_modes(mode):
    for row in range(20):
        ids, mask = synthetic_sample(mode, 128, seed=3, row=row)
        assert len(ids) == len(mask)
        assert all(0 <= i < 151643 for i in ids)
        if mode == "varlen":
            assert 16 <= len(ids) <= 128
        else:
            assert len(ids) == 128
        if mode == "fixed":
            assert all(mask)
        else:
            prompt = mask.index(True)
            # a prompt prefix of 20-80 %, then every token is supervised
            assert 0.2 * len(ids) - 1 <= prompt <= 0.8 * len(ids)
            assert all(mask[prompt:]) and not any(mask[:prompt])
    assert synthetic_sample(mode, 128, 3, 5) == synthetic_sample(mode, 128, 3, 5)
    assert synthetic_sample(mode, 128, 3, 5) != synthetic_sample(mode, 128, 4, 5)


def test_synthetic_dataloader_shapes_and_resume():
    cfg = ConfigManager().parse_args(["--data.source", "synthetic:varlen", "--data.max_length", "64",
                                      "--data.max_rows", "10"])
    kwargs = dict(dp_rank=1, dp_world=2, local_batch_size=2, seed=7, pad_multiple=16)
    loader = build_dataloader(cfg.data, build_tokenizer("qwen3"), static_shapes=False, **kwargs)
    assert loader.rows_per_rank == 5
    first = [next(loader) for _ in range(3)]
    for b in first:
        assert b["input_ids"].shape[1] % 16 == 0 and b["input_ids"].shape[1] <= 64
        assert b["loss_mask"].shape == b["input_ids"].shape
        assert int(b["valid_lengths"].max()) <= b["input_ids"].shape[1]
    assert loader.epoch == 1 and sum(loader.skip_counts.values()) == 0
    state = loader.state_dict()
    expected = [next(loader) for _ in range(2)]
    resumed = build_dataloader(cfg.data, build_tokenizer("qwen3"), static_shapes=False, **kwargs)
    resumed.load_state_dict(state)
    for want, got in zip(expected, [next(resumed) for _ in range(2)]):
        for key in want:
            assert torch.equal(want[key], got[key])
    static = build_dataloader(cfg.data, build_tokenizer("qwen3"), static_shapes=True, **kwargs)
    assert next(static)["input_ids"].shape == (2, 64)


def test_synthetic_source_refuses_a_state_of_another_row_count():
    kwargs = dict(dp_rank=0, dp_world=1, local_batch_size=2, seed=7, static_shapes=True, pad_multiple=1)
    cfg = ConfigManager().parse_args(["--data.source", "synthetic:fixed", "--data.max_length", "16",
                                      "--data.max_rows", "10"])
    loader = build_dataloader(cfg.data, build_tokenizer("qwen3"), **kwargs)
    next(loader)
    cfg.data.max_rows = 12
    other = build_dataloader(cfg.data, build_tokenizer("qwen3"), **kwargs)
    with pytest.raises(ValueError, match=r"saved with 10 rows .* synthetic source now gives 12 \(data\.max_rows"):
        other.load_state_dict(loader.state_dict())


def test_synthetic_source_rejects_unknown_mode():
    cfg = ConfigManager().parse_args(["--data.source", "synthetic:nope"])
    with pytest.raises(ValueError, match="data.source"):
        build_dataloader(cfg.data, build_tokenizer("qwen3"), dp_rank=0, dp_world=1, local_batch_size=2, seed=0,
                         static_shapes=True, pad_multiple=1)
    with pytest.raises(ValueError):
        SyntheticSourceNode("nope", num_rows=4, max_length=8, seed=0, dp_rank=0, dp_world=1)
    cfg = ConfigManager().parse_args(["--data.source", "synthetic:fixed", "--data.max_rows", "1"])
    with pytest.raises(ValueError, match="data.max_rows: 1 synthetic rows leave some of the 2 DP ranks"):
        build_dataloader(cfg.data, build_tokenizer("qwen3"), dp_rank=1, dp_world=2, local_batch_size=2, seed=0,
                         static_shapes=True, pad_multiple=1)


# ---- synthetic target ----


def test_synthetic_target_features_and_tables():
    cfg = ConfigManager().parse_args(["--target.flavor", "synthetic:debugmodel"])
    bundle = build_target(cfg, torch.device("cpu"), torch.float32)
    assert bundle.source == "synthetic:debugmodel" and bundle.family == "qwen3"
    assert list(bundle.model.parameters()) == []  # nothing for the target's FSDP wrapping to shard
    a = bundle.args
    ids = torch.zeros(2, 24, dtype=torch.long)
    aux, last = bundle.model.capture(ids, [1, 3], False)
    assert aux.shape == (2, 24, 2 * a.hidden_size) and aux.dtype == torch.float32 and last is None
    aux2, last = bundle.model.capture(ids, [0], True)
    assert aux2.shape == (2, 24, a.hidden_size) and last.shape == (2, 24, a.hidden_size)
    # the same checks as a real target's capture
    with pytest.raises(ValueError, match=rf"capture layer ids \[{a.num_hidden_layers}\] out of range"):
        bundle.model.capture(ids, [0, a.num_hidden_layers], False)
    with pytest.raises(ValueError, match="layer_ids is empty"):
        bundle.model.capture(ids, [], False)
    embed, head = bundle.model.embed_weight(), bundle.model.lm_head_weight()
    assert embed.shape == (a.vocab_size, a.hidden_size)
    assert torch.equal(embed, bundle.model.embed_weight())  # seeded: the same table every call
    assert torch.equal(embed, head) == a.tie_word_embeddings


def test_synthetic_target_rejects_unknown_flavor():
    cfg = ConfigManager().parse_args(["--target.flavor", "synthetic:nope"])
    with pytest.raises(ValueError, match="target.flavor"):
        build_synthetic_target(cfg, torch.device("cpu"), torch.float32)
