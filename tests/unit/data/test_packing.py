"""Sequence packing (data/packing.py): placement against a plain-list reference, every
conversation once per epoch, rows within max_length, the collate's document ids, and exact
resume through the whole loader (with and without the prefetch thread)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from titan_draft.config import ConfigError, JobConfig, validate_job_config
from titan_draft.config.job_config import Data
from titan_draft.data.packing import PackingNode, collate_packed
from titan_draft.data.pipeline import build_dataloader
from titan_draft.data.sources.synthetic import SyntheticSourceNode

_BUILT: list = []


@pytest.fixture(autouse=True)
def _close_loaders():
    yield
    while _BUILT:
        _BUILT.pop().close()


def _reference_rows(lengths: list[int], max_length: int, window: int, n_rows: int) -> list[list[int]]:
    """Indices of the samples of each row, placed by the rule written out plainly: the oldest
    waiting sample first, then the longest waiting one that fits (the oldest among equals)."""
    waiting, nxt, rows = [], 0, []
    for _ in range(n_rows):
        while len(waiting) < window:
            waiting.append(nxt)
            nxt += 1
        row = [waiting.pop(0)]
        room = max_length - lengths[row[0] % len(lengths)]
        while True:
            best = None
            for i in waiting:
                n = lengths[i % len(lengths)]
                if n <= room and (best is None or n > lengths[best % len(lengths)]):
                    best = i
            if best is None:
                break
            waiting.remove(best)
            row.append(best)
            room -= lengths[best % len(lengths)]
        rows.append(row)
    return rows


def _synthetic(num_rows=40, max_length=128):
    return SyntheticSourceNode("varlen", num_rows=num_rows, max_length=max_length, seed=3, dp_rank=0, dp_world=1)


@pytest.mark.parametrize("window", [1, 4, 16])
def test_placement_matches_the_reference(window):
    src = _synthetic()
    samples = list(src.usable_samples())
    lengths = [len(s[0]) for s in samples]
    node = PackingNode(_synthetic(), max_length=128, window=window)
    node.reset()
    got = [next(node) for _ in range(30)]
    want = _reference_rows(lengths, 128, window, 30)
    for row, idx in zip(got, want):
        assert [s[0] for s in row] == [samples[i % len(samples)][0] for i in idx]
        assert sum(len(s[0]) for s in row) <= 128


def test_every_conversation_once_per_pass():
    node = PackingNode(_synthetic(num_rows=50), max_length=128, window=8)
    node.reset()
    seen = []
    while len(seen) < 50 - 8:  # all but the window still waiting
        seen += [tuple(s[0]) for s in next(node)]
    first_pass = {tuple(s[0]) for s in _synthetic(num_rows=50).usable_samples()}
    assert len(seen) == len(set(seen)) and set(seen) <= first_pass


def test_state_resumes_exactly():
    node = PackingNode(_synthetic(), max_length=128, window=8)
    node.reset()
    ref = [next(node) for _ in range(40)]  # crosses into the second epoch
    for cut in (0, 3, 17, 33):
        a = PackingNode(_synthetic(), max_length=128, window=8)
        a.reset()
        for _ in range(cut):
            next(a)
        state = a.state_dict()
        assert len(state["packing"]["placed"]) <= 8 + 128 // 16  # the state stays small
        b = PackingNode(_synthetic(), max_length=128, window=8)
        b.reset(state)
        assert [next(b) for _ in range(40 - cut)] == ref[cut:]


def test_collate_packed_document_ids():
    rows = [[([1, 2, 3], [False, True, True]), ([4, 5], [True, True])], [([6] * 7, [True] * 7)]]
    b = collate_packed(rows, pad_id=0, max_length=8)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0], [6] * 7 + [0]]
    assert b["document_ids"].tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0] * 7 + [1]]
    assert b["loss_mask"].tolist()[0] == [False, True, True, True, True, False, False, False]
    assert b["valid_lengths"].tolist() == [5, 7] and b["documents"].tolist() == [2, 1]


def _conv(i, words):
    return {"conversations": [{"from": "human", "value": f"question {i} " + "x " * words},
                              {"from": "gpt", "value": f"answer {i} " + "y " * (words // 2)}]}


def _build(tok, path, prefetch):
    cfg = Data(source=path, max_length=128, packing=True, packing_window=6, chat_template="chatml",
               prefetch_factor=prefetch)
    dl = build_dataloader(cfg, tok, dp_rank=0, dp_world=1, local_batch_size=2, seed=5, static_shapes=True)
    _BUILT.append(dl)
    return dl


@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_packs_and_resumes_exactly(tok, tmp_path, prefetch):
    g = torch.Generator().manual_seed(0)
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(_conv(i, int(torch.randint(2, 40, (1,), generator=g)))) + "\n"
                            for i in range(30)))
    ref_loader = _build(tok, str(path), prefetch)
    ref = [next(ref_loader) for _ in range(12)]
    # rows hold several conversations, each whole and in its own document
    docs = torch.cat([b["documents"] for b in ref])
    assert docs.float().mean() > 1.5
    for b in ref:
        assert b["input_ids"].shape == (2, 128)
        for r in range(2):
            text = tok.decode(b["input_ids"][r, : b["valid_lengths"][r]].tolist())
            assert len(re.findall(r"question \d+", text)) == int(b["documents"][r])
    dl = _build(tok, str(path), prefetch)
    for _ in range(5):
        next(dl)
    sd = dl.state_dict()
    fresh = _build(tok, str(path), prefetch)
    fresh.load_state_dict(sd)
    for want in ref[5:]:
        got = next(fresh)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_packing_config_is_checked():
    cfg = JobConfig()
    cfg.data.packing, cfg.data.max_length = True, 1000
    with pytest.raises(ConfigError, match="data.max_length = 1000 must be a multiple of 128 with data.packing"):
        validate_job_config(cfg)
    cfg.data.max_length, cfg.data.packing_window = 1024, 0
    with pytest.raises(ConfigError, match="data.packing_window = 0 must be >= 1"):
        validate_job_config(cfg)


def test_a_packed_position_does_not_move_to_another_dp_size(tok, tmp_path):
    """The conversations a rank holds waiting in its window cannot be handed to other ranks: a
    packed state saved by 2 DP ranks is refused by 1, naming the way out."""
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(_conv(i, 5 + i % 30)) + "\n" for i in range(30)))
    cfg = Data(source=str(path), max_length=128, packing=True, packing_window=6, chat_template="chatml",
               prefetch_factor=0)
    saved = {}
    for rank in range(2):
        dl = build_dataloader(cfg, tok, dp_rank=rank, dp_world=2, local_batch_size=1, seed=5, static_shapes=True)
        _BUILT.append(dl)
        next(dl)
        saved.update(dl.state_dict())
    one = build_dataloader(cfg, tok, dp_rank=0, dp_world=1, local_batch_size=1, seed=5, static_shapes=True)
    _BUILT.append(one)
    with pytest.raises(ValueError, match="saved with 2 DP ranks, this run has 1.*reset_data_position"):
        one.load_state_dict(saved)
