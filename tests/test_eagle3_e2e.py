"""EAGLE-3 through the real trainer on CPU: its vocabulary pass, exact resume, export and the
true-τ eval; and two gloo ranks with float8 + compile + FSDP2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from models.eagle3.vocab import count_loss_tokens
from titan_draft.components.export import load_export
from titan_draft.config import ConfigManager
from titan_draft.data.pipeline import epoch_samples
from titan_draft.data.tokenizer import build_tokenizer
from titan_draft.eval import main as eval_main
from trainer_runs import run_training

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD_FRAGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp", "embed", "target_lm_head")


def _args(dump, target, data, *extra):
    return ["--job.config_file", os.path.join(REPO, "train_configs", "eagle3_debug.toml"),
            "--job.dump_folder", str(dump), "--target.path", target, "--data.source", data,
            "--data.max_length", "96", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--profiling.enable_profiling", "false", *extra]


def test_trains_resumes_exports_and_decodes(tmp_path, random_target_dir, chat_jsonl):
    common = ("--training.steps", "6", "--checkpoint.interval", "3")
    full = run_training(_args(tmp_path / "full", random_target_dir, chat_jsonl, *common))
    with pytest.raises(KeyboardInterrupt):
        run_training(_args(tmp_path / "killed", random_target_dir, chat_jsonl, *common), crash_after_step=3)
    resumed = run_training(_args(tmp_path / "killed", random_target_dir, chat_jsonl, *common))
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step

    # the vocabulary pass counted every usable row's loss tokens, as training renders them
    cfg = ConfigManager().parse_args(_args(tmp_path, random_target_dir, chat_jsonl))
    tok = build_tokenizer(random_target_dir)
    counts = count_loss_tokens(epoch_samples(cfg.data, tok, dp_rank=0, dp_world=1, seed=0), tok.n_vocab)
    with safe_open(str(tmp_path / "full" / "draft_vocab.safetensors"), "pt") as f:
        saved = f.get_tensor("counts")
        t2d = f.get_tensor("t2d")
    assert torch.equal(saved[: tok.n_vocab], counts) and int(t2d.sum()) == 512
    # a job on other data is refused the saved vocabulary, naming the field
    with pytest.raises(ValueError, match="counted with data.max_length = 96, this job has 64"):
        run_training(_args(tmp_path / "killed", random_target_dir, chat_jsonl, *common, "--data.max_length", "64"))

    tensors, config = load_export(str(tmp_path / "full" / "export"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 512
    assert all(not any(b in k for b in BAD_FRAGMENTS) for k in tensors)
    assert torch.equal(tensors["t2d"][: tok.n_vocab], t2d[: tok.n_vocab])
    out = tmp_path / "tau.json"
    eval_main(["--target", random_target_dir, "--draft", str(tmp_path / "full" / "export"), "--prompts", "mtbench",
               "--num-prompts", "2", "--max-new-tokens", "12", "--out", str(out)])
    summary = json.loads(out.read_text())["summary"]
    assert summary["lossless_prompts"] == 2 and summary["num_draft_tokens"] == 3


@pytest.mark.slow
def test_two_rank_gloo_float8_compile_fsdp(tmp_path, random_target_dir, chat_jsonl):
    argv = _args(tmp_path, random_target_dir, chat_jsonl, "--training.steps", "3", "--checkpoint.interval", "3",
                 "--compile.enable", "true", "--float8.enable", "true", "--data.max_length", "64")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", "localhost:0", "-m", "titan_draft.train", *argv]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    info = json.loads((tmp_path / "run_info.json").read_text())
    f8 = info["float8"]
    assert info["world_size"] == 2 and f8["converted"] == 7, f8  # the midlayer's q k v o gate up down
    assert f8["skipped"]["fc"].startswith("kept") and f8["skipped"]["lm_head"].startswith("kept")
    # both ranks' rows were counted into one vocabulary
    cfg = ConfigManager().parse_args(argv)
    tok = build_tokenizer(random_target_dir)
    both = sum(count_loss_tokens(epoch_samples(cfg.data, tok, dp_rank=r, dp_world=2, seed=0), tok.n_vocab)
               for r in range(2))
    with safe_open(str(tmp_path / "draft_vocab.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("counts")[: tok.n_vocab], both)
    tensors, _ = load_export(str(tmp_path / "export"))
    assert all(not any(b in k for b in BAD_FRAGMENTS) for k in tensors)
