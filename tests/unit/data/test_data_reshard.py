"""A data position resumed on another DP size: the exact cases continue what the saved run would
have read (checked against that run left uninterrupted), the others are refused in one line (the
offline cache's twin is in tests/integration/offline/test_offline_source.py)."""

import json
import re

import pytest

from titan_draft.config.job_config import Data
from titan_draft.data.pipeline import build_dataloader
from titan_draft.data.reshard import reshard_position


def _source(tmp_path, n, bad=()):
    """``n`` rows whose answers name their row number; rows in ``bad`` are not JSON (skipped)."""
    lines = ["{not json" if i in bad else json.dumps(
        {"conversations": [{"from": "human", "value": f"q {i}"}, {"from": "gpt", "value": f"answer {i}"}]})
        for i in range(n)]
    path = tmp_path / f"rows{n}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _loaders(tok, source, world, bs, shuffle=False):
    cfg = Data(source=source, max_length=64, chat_template="chatml", shuffle=shuffle)
    return [build_dataloader(cfg, tok, dp_rank=r, dp_world=world, local_batch_size=bs, seed=7, static_shapes=False)
            for r in range(world)]


def _rows(batch, tok):
    return [int(re.search(r"answer (\d+)", tok.decode(ids[:n].tolist())).group(1))
            for ids, n in zip(batch["input_ids"], batch["valid_lengths"])]


def _step(loaders, tok):
    """One step's rows in global order: rank r's j-th sample of the step is global sample r + j * world."""
    per_rank = [_rows(next(dl), tok) for dl in loaders]
    return [per_rank[g % len(loaders)][g // len(loaders)] for g in range(sum(map(len, per_rank)))]


def _resume(tok, source, saved, world, bs, shuffle=False):
    """``world`` new loaders given the merged state of the saved ranks (what the checkpoint hands them)."""
    merged = {k: v for dl in saved for k, v in dl.state_dict().items()}
    new = _loaders(tok, source, world, bs, shuffle)
    for dl in new:
        dl.load_state_dict(merged)
    return new


def test_2_to_4_ranks_continue_the_same_global_samples_in_the_same_order(tok, tmp_path):
    src = _source(tmp_path, 24)  # 6 steps of 4 samples an epoch; the resumed run crosses into epoch 1
    ref = _loaders(tok, src, 2, 2)
    before = [_step(ref, tok) for _ in range(3)]
    resumed = _resume(tok, src, ref, 4, 1)  # the same global batch of 4, split over 4 ranks
    after_ref = [_step(ref, tok) for _ in range(8)]
    after = [_step(resumed, tok) for _ in range(8)]
    assert after == after_ref
    assert sorted(sum(before + after[:3], [])) == list(range(24))  # the first epoch: every row once
    assert [dl.epoch for dl in resumed] == [1] * 4


def test_4_to_2_ranks_continue_when_the_positions_interleave(tok, tmp_path):
    src = _source(tmp_path, 16)
    ref = _loaders(tok, src, 4, 1)
    [_step(ref, tok) for _ in range(3)]
    resumed = _resume(tok, src, ref, 2, 2)
    assert [_step(resumed, tok) for _ in range(4)] == [_step(ref, tok) for _ in range(4)]


def test_skipped_rows_are_neither_lost_nor_read_twice(tok, tmp_path):
    src = _source(tmp_path, 24, bad={4, 6})  # both on saved rank 0, which runs two rows ahead
    saved = _loaders(tok, src, 2, 2)
    read = sum((_step(saved, tok) for _ in range(2)), [])
    resumed = _resume(tok, src, saved, 4, 1)
    for dl in resumed:
        while dl.epoch == 0:  # this rank's rest of epoch 0
            read += _rows(next(dl), tok)
    assert sorted(read) == [i for i in range(24) if i not in (4, 6)]
    assert all(dl.skip_counts["bad_json"] == 0 for dl in resumed)  # the counts restart


def test_merging_ranks_that_skipped_apart_is_refused(tok, tmp_path):
    src = _source(tmp_path, 16, bad={0, 4})  # saved rank 0 reads 8 and 12 while rank 2 reads 2 and 6
    saved = _loaders(tok, src, 4, 1)
    [_step(saved, tok) for _ in range(2)]
    with pytest.raises(ValueError, match=r"^data: the data position saved by 4 DP ranks cannot be moved exactly to "
                                         r"2: the rows read in epoch 0 are not the first rows of DP rank 0's share in "
                                         r"source order .*; resume with 4 DP ranks, or set "
                                         r"checkpoint.reset_data_position = true"):
        _resume(tok, src, saved, 2, 2)


def test_with_shuffle_only_an_epoch_boundary_moves(tok, tmp_path):
    src = _source(tmp_path, 24)
    saved = _loaders(tok, src, 2, 2, shuffle=True)
    _step(saved, tok)
    with pytest.raises(ValueError, match=r"cannot be moved exactly to 4: with data.shuffle each rank reads its own "
                                         r"rows in an order of its own, .* exact only at an epoch boundary\); resume "
                                         r"with 2"):
        _resume(tok, src, saved, 4, 1, shuffle=True)
    [_step(saved, tok) for _ in range(5)]  # both saved ranks have read their 12 rows: epoch 1 begins
    resumed = _resume(tok, src, saved, 4, 1, shuffle=True)
    fresh = _loaders(tok, src, 4, 1, shuffle=True)  # a 4-rank run that got to epoch 1 by itself
    [_step(fresh, tok) for _ in range(6)]
    epoch1 = [_step(resumed, tok) for _ in range(6)]
    assert epoch1 == [_step(fresh, tok) for _ in range(6)]
    assert sorted(sum(epoch1, [])) == list(range(24))


def test_reshard_position_refuses_what_one_position_cannot_express():
    order = lambda n, epoch: list(range(n))  # noqa: E731
    saved = [{"epoch": 2, "position": 1, "num_rows": 3}, {"epoch": 0, "position": 2, "num_rows": 3}]
    with pytest.raises(ValueError, match=r"DP rank 0's rows were read from 1 to 3 times by the saved run"):
        reshard_position(saved, new_rank=0, new_world=3, num_rows=2, order=order, shuffled=False)
    with pytest.raises(ValueError, match=r"saved over 6 rows \(\[3, 3\] per rank\) but DP rank 1 of 3 now has 3 rows "
                                         r"\(data.source / data.max_rows changed\?\)"):
        reshard_position(saved, new_rank=1, new_world=3, num_rows=3, order=order, shuffled=False)
    # saved rank 0 (rows 0, 2, 4) read 0 and 2, rank 1 (rows 1, 3, 5) nothing: one rank now owns 0..5
    saved = [{"epoch": 0, "position": 2, "num_rows": 3}, {"epoch": 0, "position": 0, "num_rows": 3}]
    with pytest.raises(ValueError, match="not the first rows of DP rank 0's share"):
        reshard_position(saved, new_rank=0, new_world=1, num_rows=6, order=order, shuffled=False)
    saved[1]["position"] = 1  # ... and row 1: rows 0, 1, 2 read
    assert reshard_position(saved, new_rank=0, new_world=1, num_rows=6, order=order, shuffled=False) == (0, 3)


def test_a_loader_that_cannot_move_its_position_refuses_and_keeps_its_own():
    import pickle

    import torchdata.nodes as tn

    from titan_draft.data.loader_state import RankStateLoader

    dl = RankStateLoader(tn.Loader(tn.IterableWrapper(range(3))), source_key="none", dp_rank=0, dp_world=4,
                         rows_per_rank=3)
    with pytest.raises(ValueError, match=r"^data: the dataloader state was saved with 2 DP ranks, this run has 4, and "
                                         r"RankStateLoader cannot move its position to another DP size; resume with 2"):
        dl.load_state_dict({"dp_rank_0": pickle.dumps({}), "dp_rank_1": pickle.dumps({}), "world_size": 2})
    assert list(dl) == [0, 1, 2]  # untouched


def test_synthetic_rows_move_like_conversations(tok):
    def loaders(world, bs):
        cfg = Data(source="synthetic:fixed", max_length=16, max_rows=16)
        return [build_dataloader(cfg, tok, dp_rank=r, dp_world=world, local_batch_size=bs, seed=7, static_shapes=True)
                for r in range(world)]

    def step(dls):  # the step's samples (first tokens) in global order
        per_rank = [next(dl)["input_ids"][:, 0].tolist() for dl in dls]
        return [per_rank[g % len(dls)][g // len(dls)] for g in range(4)]

    ref = loaders(2, 2)
    [step(ref) for _ in range(3)]
    merged = {k: v for dl in ref for k, v in dl.state_dict().items()}
    resumed = loaders(4, 1)
    for dl in resumed:
        dl.load_state_dict(merged)
    assert [step(resumed) for _ in range(3)] == [step(ref) for _ in range(3)]
