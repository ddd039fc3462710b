"""The offline features source: exact resume of the shard stream (mid-epoch, across epochs, and
through the trainer's checkpoints), disjoint DP ranks, and caches that must be refused before
training starts, each with one line naming the file or field."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from helpers import job_argv, Paths, prepare_cache, run_training
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import main as train_main


def _refused(argv) -> str:
    """The one-line ValueError a job fails with before its first step."""
    try:
        with pytest.raises(ValueError) as e:
            run_training(argv)
    finally:
        destroy_distributed()  # the Trainer died after joining its process group
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.fixture(scope="module")
def cache(tmp_path_factory, random_target_dir, chat_jsonl):
    """A dflash2 cache (bfloat16, the default storage) of 14 rows in several small shards."""
    root = tmp_path_factory.mktemp("offline")
    argv = job_argv("dflash2", root / "dump", random_target_dir, chat_jsonl)
    manifest = prepare_cache(root / "cache", argv, "--shard-mb", "0.03")
    assert len(manifest["shards"]) >= 4, manifest["shards"]
    return {"folder": str(root / "cache"), "argv": argv, "manifest": manifest}


def _row_ids(loader, n_batches):
    return [r for _ in range(n_batches) for r in next(loader)["row_ids"].tolist()]


def test_resume_mid_epoch_and_across_epochs(cache):
    paths = Paths(cache["argv"])
    rows = cache["manifest"]["rows"]
    per_epoch = rows // 2
    reference = _row_ids(paths.offline(cache["folder"], shuffle=True), 3 * per_epoch)
    # every epoch reads every row once, each epoch in its own seeded order
    epochs = [reference[i * rows:(i + 1) * rows] for i in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) and len(set(e)) == rows for e in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])
    assert _row_ids(paths.offline(cache["folder"], shuffle=True), 4) == reference[:8]  # seeded
    for cut in (3, per_epoch + 2):  # mid-epoch; in the second epoch after a roll-over
        first = paths.offline(cache["folder"], shuffle=True)
        head = _row_ids(first, cut)
        state = first.state_dict()
        resumed = paths.offline(cache["folder"], shuffle=True)
        resumed.load_state_dict(state)
        assert head + _row_ids(resumed, 2 * per_epoch - cut) == reference[:4 * per_epoch], cut
    # a state saved over other shards is refused
    other = paths.offline(cache["folder"], shuffle=True, dp_rank=1, dp_world=2)
    with pytest.raises(ValueError, match="feature_cache changed"):
        other.load_state_dict({"world_size": 2, "dp_rank_1": state["dp_rank_0"]})
        next(other)


def test_two_dp_ranks_read_disjoint_rows(cache):
    paths = Paths(cache["argv"])
    seen = []
    for rank in (0, 1):
        loader = paths.offline(cache["folder"], shuffle=True, dp_rank=rank, dp_world=2)
        ids = _row_ids(loader, loader.rows_per_rank // 2)
        assert len(set(ids)) == len(ids)
        seen.append(set(ids))
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) >= cache["manifest"]["rows"] - 2  # the larger rank's extra rows


def test_trainer_resume_is_exact(cache, tmp_path, random_target_dir, chat_jsonl):
    def argv(dump):
        return job_argv("dflash2", dump, random_target_dir, chat_jsonl, "--data.feature_cache", cache["folder"],
                        "--data.shuffle", "true", "--training.steps", "5", "--checkpoint.enable", "true",
                        "--checkpoint.interval", "2")
    full = run_training(argv(tmp_path / "full"))
    with pytest.raises(KeyboardInterrupt):
        run_training(argv(tmp_path / "killed"), crash_after_step=2)
    resumed = run_training(argv(tmp_path / "killed"))
    assert sorted(resumed) == [3, 4, 5]
    assert all(resumed[s] == full[s] for s in (3, 4, 5)), (resumed, full)


def _copy(cache, tmp_path):
    folder = tmp_path / "cache"
    shutil.copytree(cache["folder"], folder)
    return str(folder)


def _main_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        train_main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def _shard(folder, cache, i=0):
    return os.path.join(folder, cache["manifest"]["shards"][i]["file"])


def test_missing_and_truncated_shard_refused_before_start(cache, tmp_path, capsys):
    folder = _copy(cache, tmp_path)
    argv = cache["argv"] + ["--data.feature_cache", folder]
    path = _shard(folder, cache, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    assert f"shard {path} has" in _main_error(capsys, argv)
    os.remove(path)
    assert f"shard {path} listed in manifest.json is missing" in _main_error(capsys, argv)
    os.remove(os.path.join(folder, "manifest.json"))
    err = _main_error(capsys, argv)
    assert "manifest.json is missing (an unfinished prepare" in err


def test_checksum_mismatch_refused_before_start(cache, tmp_path):
    folder = _copy(cache, tmp_path)
    path = _shard(folder, cache, 0)
    with open(path, "r+b") as f:  # same size, one flipped byte in the features
        f.seek(os.path.getsize(path) - 10)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert _refused(cache["argv"] + ["--data.feature_cache", folder]) == (
        f"data.feature_cache: shard {path} fails its sha256 checksum (corrupted; delete it and its index line, "
        "then run prepare again)")
    # without the checksum pass, the size check alone cannot see it (and says nothing)
    assert run_training(cache["argv"] + ["--data.feature_cache", folder, "--data.feature_cache_verify", "false",
                                         "--training.steps", "1"])


@pytest.mark.parametrize("override, match", [
    (["--data.max_length", "32"],
     r"^data.max_length: .*manifest.json was captured with max_length 48, this job has 32$"),
    (["--target.capture_layers", "[0, 2]"], r"^target.capture_layers: .*manifest.json holds capture layers \[1, 3\]"),
    (["--data.enable_thinking", "true"], r"^data.enable_thinking: .*manifest.json was captured with enable_thinking"),
    (["--data.system_prompt", "You are a pirate."], r"^data.system_prompt: .*manifest.json was captured with system"),
])
def test_manifest_mismatch_names_the_field(cache, override, match):
    assert re.search(match, _refused(cache["argv"] + ["--data.feature_cache", cache["folder"], *override]))


def test_draft_needing_last_hidden_refused(cache, tmp_path):
    folder = _copy(cache, tmp_path)
    argv = [a if a != cache["argv"][1] else cache["argv"][1].replace("debug_random", "eagle3_debug")
            for a in cache["argv"]]
    path = os.path.join(folder, "manifest.json")
    manifest = json.load(open(path))
    manifest["facts"]["capture_layers"] = Paths(argv).layer_ids  # EAGLE-3's layers, but no last hidden
    json.dump(manifest, open(path, "w"))
    err = _refused(argv + ["--data.feature_cache", folder])
    assert err.startswith("model.name: this draft needs the target's final-norm last hidden state, which "
                          f"{path} lacks"), err


def test_other_target_refused(cache, tmp_path):
    folder = _copy(cache, tmp_path)
    manifest = json.load(open(os.path.join(folder, "manifest.json")))
    manifest["facts"]["target_config_hash"] = "0" * 64
    json.dump(manifest, open(os.path.join(folder, "manifest.json"), "w"))
    err = _refused(cache["argv"] + ["--data.feature_cache", folder])
    assert err.startswith(f"target.path: {folder}/manifest.json was captured with target "), err


def _merged(loaders):
    return {k: v for dl in loaders for k, v in dl.state_dict().items()}


@pytest.mark.parametrize("shuffle", [False, True])
def test_another_dp_size_reads_the_rest_of_the_epoch_once(cache, shuffle):
    paths = Paths([*cache["argv"], "--training.local_batch_size", "1"])
    rows = cache["manifest"]["rows"]
    every_row = sorted(_row_ids(paths.offline(cache["folder"], shuffle=False), rows))
    saved = [paths.offline(cache["folder"], shuffle=shuffle, dp_rank=r, dp_world=2) for r in range(2)]
    read = _row_ids(saved[0], 4) + _row_ids(saved[1], 1)  # 1 shard and a row of the next; a part of one
    for r in range(4):
        dl = paths.offline(cache["folder"], shuffle=shuffle, dp_rank=r, dp_world=4)
        dl.load_state_dict(_merged(saved))
        while dl.epoch == 0:  # this rank's rest of epoch 0
            read += next(dl)["row_ids"].tolist()
    assert sorted(read) == every_row  # each row of the epoch exactly once


def test_a_feature_position_that_no_new_rank_state_expresses_is_refused():
    from titan_draft.data.features.reshard import reshard_feature_position

    rows = {"a": 2, "b": 2, "c": 2, "d": 2}
    in_order = lambda n, epoch: list(range(n))  # noqa: E731
    backwards_of_4 = lambda n, epoch: list(range(n))[::-1] if n == 4 else list(range(n))  # noqa: E731
    row_order = lambda f, n, epoch: list(range(n))  # noqa: E731
    # one saved rank (a, b, c, d) has read a and half of b; new rank 0 of 2 owns a and c
    saved = [{"epoch": 0, "shard_pos": 1, "row_pos": 1, "files": ["a", "b", "c", "d"]}]
    kw = dict(new_rank=0, new_world=2, row_order=row_order)
    assert reshard_feature_position(saved, [["a", "b", "c", "d"]], ["a", "c"], rows, shard_order=in_order,
                                    shuffled=False, **kw) == (0, 1, 0)
    assert reshard_feature_position(saved, [["a", "b", "c", "d"]], ["b", "d"], rows, shard_order=in_order,
                                    shuffled=False, **{**kw, "new_rank": 1}) == (0, 0, 1)
    # visited backwards (d, c, b, a) by the saved rank it read d and half of c; new rank 0 goes a, c
    with pytest.raises(ValueError, match=r"^data: the data position saved by 1 DP ranks cannot be moved exactly to 2: "
                                         r"with data.shuffle each rank visits its own shards .* DP rank 0's order"):
        reshard_feature_position(saved, [["a", "b", "c", "d"]], ["a", "c"], rows, shard_order=backwards_of_4,
                                 shuffled=True, **kw)
    with pytest.raises(ValueError, match=r"saved over feature shards \['a', 'b', 'c'\]\.\.\. but that rank would "
                                         r"now read \['a', 'b'\]\.\.\.: data.feature_cache changed\?"):
        reshard_feature_position(saved, [["a", "b"]], ["a"], rows, shard_order=in_order, shuffled=False, **kw)
