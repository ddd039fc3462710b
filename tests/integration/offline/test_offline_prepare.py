"""scripts/prepare_features.py: an interrupted run resumes to the same cache, a resume with other
settings is refused, and two torchrun ranks shard the target and the rows as training does."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from helpers import job_argv, prepare_cache, torchrun
from titan_draft.data.features.manifest import load_manifest
from titan_draft.data.features.writer import ShardWriter


def _shards(folder, manifest):
    """Every shard's name, rows and tensors (sha256 is of the bytes, and safetensors writes its
    metadata in no fixed order)."""
    out = []
    for s in manifest["shards"]:
        with safe_open(os.path.join(folder, s["file"]), "pt") as f:
            out.append((s["file"], s["rows"], {k: f.get_tensor(k) for k in f.keys()}))
    return out


def _same(a, b):
    return len(a) == len(b) and all(x[:2] == y[:2] and x[2].keys() == y[2].keys()
                                    and all(torch.equal(x[2][k], y[2][k]) for k in x[2]) for x, y in zip(a, b))


def test_interrupted_prepare_resumes_to_the_same_cache(tmp_path, random_target_dir, chat_jsonl, monkeypatch):
    argv = job_argv("dflash2", tmp_path / "dump", random_target_dir, chat_jsonl)
    options = ("--shard-mb", "0.03")
    reference = prepare_cache(tmp_path / "ref", argv, *options)
    # --estimate renders the same rows and predicts the bytes (the files add only their headers)
    est = prepare_cache(tmp_path / "est", argv, *options, "--estimate")
    assert (est["rows"], est["tokens"]) == (reference["rows"], reference["tokens"])
    assert 0 <= reference["bytes"] - est["bytes"] < 1024 * len(reference["shards"])
    assert not (tmp_path / "est").exists()

    add, calls = ShardWriter.add, []

    def add_then_die(self, *a, **kw):
        calls.append(1)
        if len(calls) == 8:
            self._pool.shutdown(wait=True)  # the shards already handed over are written, then the kill
            raise KeyboardInterrupt("simulated kill")
        add(self, *a, **kw)

    monkeypatch.setattr(ShardWriter, "add", add_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare_cache(tmp_path / "cut", argv, *options)
    monkeypatch.setattr(ShardWriter, "add", add)
    cut = tmp_path / "cut"
    assert not json.loads((cut / "manifest.json").read_text())["complete"]
    assert len((cut / "index.rank000.jsonl").read_text().splitlines()) == 2  # two shards were finished
    # what a kill can leave: a half-written shard, a whole shard not yet listed, a cut index line
    (cut / "shard-r000-00003.safetensors.tmp").write_bytes(b"half a shard")
    (cut / "shard-r000-00009.safetensors").write_bytes(b"not listed")
    with open(cut / "index.rank000.jsonl", "a") as f:
        f.write('{"file": "shard-r000-0000')
    with pytest.raises(ValueError, match="is not complete"):  # training refuses it meanwhile
        load_manifest(str(cut))
    resumed = prepare_cache(cut, argv, *options)
    assert len(resumed["shards"]) >= 4 and _same(_shards(cut, resumed), _shards(tmp_path / "ref", reference))
    assert resumed["rows"] == reference["rows"] and resumed["facts"] == reference["facts"]
    assert sorted(os.listdir(cut)) == sorted(os.listdir(tmp_path / "ref"))

    with pytest.raises(ValueError, match="is already complete"):
        prepare_cache(cut, argv, *options)
    (cut / "manifest.json").write_text(json.dumps({**resumed, "complete": False}))
    with pytest.raises(ValueError, match=r"^--out: .*manifest.json was started with storage 'bfloat16', this run "
                                         r"has 'float8_e4m3'$"):
        prepare_cache(cut, argv, *options, "--storage", "float8_e4m3")
    with pytest.raises(ValueError, match=r"^--out: .*manifest.json was started with another max_length"):
        prepare_cache(cut, argv + ["--data.max_length", "32"], *options)


def _rows(folder):
    """{tuple(input_ids): hidden of layer 1} of every row of a cache."""
    out = {}
    manifest = json.loads(open(os.path.join(folder, "manifest.json")).read())
    for s in manifest["shards"]:
        with safe_open(os.path.join(folder, s["file"]), "pt") as f:
            ids, lengths, hidden = f.get_tensor("input_ids"), f.get_tensor("lengths"), f.get_tensor("hidden.1")
        start = 0
        for n in lengths.tolist():
            out[tuple(ids[start:start + n].tolist())] = hidden[start:start + n]
            start += n
    return manifest, out


@pytest.mark.slow
def test_two_rank_prepare_and_offline_training(tmp_path, random_target_dir, chat_jsonl):
    argv = job_argv("dflash2", tmp_path / "dump", random_target_dir, chat_jsonl)
    options = ["--storage", "float32", "--shard-mb", "0.03"]
    prepare_cache(tmp_path / "one", argv, *options)
    proc = torchrun(2, "scripts/prepare_features.py", "--out", str(tmp_path / "two"), *options, *argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    one, one_rows = _rows(tmp_path / "one")
    two, two_rows = _rows(tmp_path / "two")
    assert {s["rank"] for s in two["shards"]} == {0, 1} and two["prepare_world"] == 2
    # the same usable rows, each captured once, by an FSDP-sharded target: the same features
    assert sorted(two_rows) == sorted(one_rows) and two["rows"] == one["rows"]
    for ids, hidden in two_rows.items():
        torch.testing.assert_close(hidden, one_rows[ids], rtol=1e-5, atol=1e-5)

    # two training ranks on the cache: each reads its own shards (disjoint rows) and the job runs
    train = job_argv("dflash2", tmp_path / "train", random_target_dir, chat_jsonl, "--training.steps", "2",
                     "--data.feature_cache", str(tmp_path / "two"))
    proc = torchrun(2, "-m", "titan_draft.train", *train)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    info = json.loads((tmp_path / "train" / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["features"].startswith(f"offline: {tmp_path / 'two'}")
    mine = len(two["shards"][0::2])  # rank 0 reads every other shard (the rows' split is tested on its own)
    assert f"feature cache {tmp_path / 'two'}, {mine} shards / " in proc.stdout + proc.stderr
