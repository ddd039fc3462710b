"""Two gloo ranks with float8 + per-block compile + FSDP2, for every draft: the drafts' jobs run one
after another in one torchrun launch (tests/workers/two_rank_worker.py), so the process group and
compile's warm-up are set up once; each draft's test reads its own job's outputs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from models.eagle3.vocab import count_loss_tokens
from titan_draft.checkpoint.export import load_export
from titan_draft.config import ConfigManager
from titan_draft.data.pipeline import epoch_samples
from titan_draft.data.tokenizer import build_tokenizer
from helpers import REPO, debug_job_argv, torchrun

pytestmark = pytest.mark.slow

WRAPPERS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp")
# One row per rank and step, 64 tokens (float8 needs a multiple of 16). Compile runs the aot_eager
# backend: dynamo and AOT autograd trace each draft's float8 blocks under FSDP2 (and leave the
# wrapper prefixes the checkpoint and export must drop), without inductor's C++ build, which
# cost the suite ~25 s here with a warm cache and more on a fresh CI machine; inductor's kernels
# for these blocks are what the GPU tests and benchmarks run.
F8_JOB = ("--training.steps", "2", "--checkpoint.interval", "2", "--compile.enable", "true",
          "--compile.backend", "aot_eager",
          "--float8.enable", "true", "--data.max_rows", "0", "--training.local_batch_size", "1")
DRAFTS = ("dflash2", "dspark", "eagle3")


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, random_target_dir, chat_jsonl):
    """One launch for the module; returns ``run(name) -> (dump folder, argv)`` of a draft's job,
    which fails the calling test unless that job finished on both ranks."""
    root = tmp_path_factory.mktemp("two_rank_float8")
    jobs = {name: debug_job_argv(name, root / name, random_target_dir, chat_jsonl, *F8_JOB, max_length=64)
            for name in DRAFTS}
    (root / "jobs.json").write_text(json.dumps(jobs))
    proc = torchrun(2, os.path.join(REPO, "tests", "workers", "two_rank_worker.py"), str(root / "jobs.json"), str(root),
                    timeout=900)
    ranks = [json.loads(p.read_text()) if p.exists() else {} for p in (root / "rank0.json", root / "rank1.json")]

    def run(name):
        for r, res in enumerate(ranks):
            if name not in res:
                failed = [n for n in DRAFTS if "error" in ranks[0].get(n, {}) or "error" in ranks[1].get(n, {})]
                pytest.fail(f"{name}: rank {r} did not finish its job (failed before it: {failed}; torchrun exit "
                            f"{proc.returncode})\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}")
            assert "error" not in res[name], f"{name}, rank {r}:\n{res[name]['error']}"
            assert res[name]["steps"] == [1, 2], (name, r, res[name])
        if all(n in res and "error" not in res[n] for res in ranks for n in DRAFTS):  # else the exit is theirs
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        return root / name, jobs[name]

    return run


def _clean_export(dump, frozen=("embed", "lm_head")):
    """The export's tensors, none under a wrapper's prefix or a frozen table's name."""
    tensors, _ = load_export(str(dump / "export"))
    bad = (*WRAPPERS, *frozen)
    assert all(not any(b in k for b in bad) for k in tensors), sorted(tensors)
    return tensors


def test_dflash2(two_rank_runs):
    dump, _ = two_rank_runs("dflash2")
    info = json.loads((dump / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["compile"] is True and info["float8"]
    assert info["compile_target"] is True  # the FSDP-sharded target captured through its compiled layer
    # the trainer converts before parallelize_fn: every block Linear (2 layers x q k v o, gate up
    # down, two conv kernel projections), never the Linears the draft keeps in high precision
    f8 = info["float8"]
    assert f8["converted"] == 18, f8
    assert f8["skipped"]["fc"].startswith("kept in high precision")
    assert f8["skipped"]["candidate_selector.hidden_projection"].startswith("kept in high precision")

    from torch.distributed.checkpoint import FileSystemReader

    keys = list(FileSystemReader(str(dump / "checkpoint" / "step-2")).read_metadata().state_dict_metadata)
    model_keys = [k for k in keys if k.startswith("model.") or k.startswith("layers.") or ".weight" in k]
    assert model_keys, keys
    bad = [k for k in keys if any(b in k for b in (*WRAPPERS, "embed", "lm_head"))]
    assert not bad, bad
    assert any("dp_rank_1" in k for k in keys) and any("dp_rank_0" in k for k in keys)
    tensors = _clean_export(dump)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values() if t.is_floating_point())


def test_dspark(two_rank_runs):
    dump, _ = two_rank_runs("dspark")
    info = json.loads((dump / "run_info.json").read_text())
    f8 = info["float8"]
    assert info["world_size"] == 2 and f8["converted"] == 14, f8  # 2 layers x q k v o gate up down
    for name in ("fc", "markov_head.markov_w2", "confidence_head.proj"):
        assert f8["skipped"][name].startswith("kept"), (name, f8["skipped"])
    _clean_export(dump)


def test_eagle3(two_rank_runs, random_target_dir):
    dump, argv = two_rank_runs("eagle3")
    info = json.loads((dump / "run_info.json").read_text())
    f8 = info["float8"]
    assert info["world_size"] == 2 and f8["converted"] == 7, f8  # the midlayer's q k v o gate up down
    assert f8["skipped"]["fc"].startswith("kept") and f8["skipped"]["lm_head"].startswith("kept")
    # both ranks' rows were counted into one vocabulary
    cfg = ConfigManager().parse_args(argv)
    tok = build_tokenizer(random_target_dir)
    both = sum(count_loss_tokens(epoch_samples(cfg.data, tok, dp_rank=r, dp_world=2, seed=0), tok.n_vocab)
               for r in range(2))
    with safe_open(str(dump / "draft_vocab.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("counts")[: tok.n_vocab], both)
    _clean_export(dump, frozen=("embed", "target_lm_head"))  # its own lm_head is served
