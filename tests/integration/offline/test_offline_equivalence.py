"""Offline = online: the same rows through the target and through a feature cache give the same
TargetFeatures and, through the real trainer, the same losses, for every registered draft."""

from __future__ import annotations

import pytest
import torch

from helpers import job_argv, Paths, prepare_cache, registered_drafts, run_training


def _assert_same_features(on, off):
    assert torch.equal(on.input_ids, off.input_ids) and torch.equal(on.loss_mask, off.loss_mask)
    assert torch.equal(on.valid_lengths, off.valid_lengths)
    assert (on.document_ids is None) == (off.document_ids is None)
    if on.document_ids is not None:
        assert torch.equal(on.document_ids, off.document_ids)
    assert off.aux_hidden.dtype == on.aux_hidden.dtype and off.aux_hidden.shape == on.aux_hidden.shape
    # positions past a row's end are the target's output on padding online, zeros offline: the
    # drafts never read them (the losses below agree exactly)
    valid = torch.arange(on.input_ids.shape[1])[None, :] < on.valid_lengths[:, None]
    assert torch.equal(on.aux_hidden[valid], off.aux_hidden[valid])
    assert not off.aux_hidden[~valid].any()
    assert (on.last_hidden is None) == (off.last_hidden is None)
    if on.last_hidden is not None:
        assert torch.equal(on.last_hidden[valid], off.last_hidden[valid])


# packed: short conversations, several to a row, captured one by one offline and as packed rows
# online (the target's document mask must make them equal)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("draft", registered_drafts())
def test_online_equals_offline(draft, packed, tmp_path, random_target_dir, chat_jsonl, short_chat_jsonl):
    data = short_chat_jsonl if packed else chat_jsonl
    extra = ("--data.packing", "true", "--data.max_length", "128", "--data.max_rows", "40") if packed else ()
    argv = job_argv(draft, tmp_path / "dump", random_target_dir, data, "--training.steps", "3", *extra)
    # float32 storage: the CPU target's exact output (bfloat16 storage is tested on its own)
    manifest = prepare_cache(tmp_path / "cache", argv, "--storage", "float32", "--shard-mb", "0.1")
    assert len(manifest["shards"]) >= 2 and manifest["rows"] >= 8
    paths = Paths(argv)
    offline = paths.offline(str(tmp_path / "cache"))
    n = 0
    for (batch_on, on), batch_off in zip(paths.online(), offline):
        _assert_same_features(on, paths.features(batch_off))
        if packed:
            assert batch_on["documents"].min() >= 2  # the rows really are packed
        n += 1
        if n == manifest["rows"] // 2 + 1:  # one epoch and a batch into the next
            break

    online_losses = run_training(job_argv(draft, tmp_path / "on", random_target_dir, data,
                                          "--training.steps", "3", *extra))
    offline_losses = run_training(job_argv(draft, tmp_path / "off", random_target_dir, data,
                                           "--training.steps", "3", *extra, "--data.feature_cache", str(tmp_path / "cache")))
    assert sorted(online_losses) == [1, 2, 3]
    assert offline_losses == online_losses
