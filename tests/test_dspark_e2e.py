"""DSpark through the real, unchanged trainer on CPU: exact kill-and-resume, the export and the
true-τ eval CLI on it (at two confidence thresholds); and two gloo ranks with float8 + compile +
FSDP2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from titan_draft.components.export import load_export
from titan_draft.eval import main as eval_main
from trainer_runs import run_training

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BAD_FRAGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp", "embed", "target_lm_head")


def _args(dump, target, data, *extra):
    return ["--job.config_file", os.path.join(REPO, "train_configs", "dspark_debug.toml"),
            "--job.dump_folder", str(dump), "--target.path", target, "--data.source", data,
            "--data.max_length", "96", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
            "--profiling.enable_profiling", "false", *extra]


def test_trains_resumes_exports_and_decodes(tmp_path, random_target_dir, chat_jsonl):
    common = ("--training.steps", "6", "--checkpoint.interval", "3")
    full = run_training(_args(tmp_path / "full", random_target_dir, chat_jsonl, *common))
    assert full[6] < full[1]  # it learns something in six steps
    with pytest.raises(KeyboardInterrupt):
        run_training(_args(tmp_path / "killed", random_target_dir, chat_jsonl, *common), crash_after_step=3)
    resumed = run_training(_args(tmp_path / "killed", random_target_dir, chat_jsonl, *common))
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5, abs=1e-6), step

    tensors, config = load_export(str(tmp_path / "full" / "export"))
    assert config["architectures"] == ["DSparkDraftModel"] and config["block_size"] == 4
    assert config["markov_head_type"] == "vanilla" and config["enable_confidence_head"] is True
    assert all(not any(b in k for b in BAD_FRAGMENTS) for k in tensors)
    assert "markov_head.markov_w2.weight" in tensors and "confidence_head.proj.weight" in tensors
    taus = {}
    for thr in ("0", "0.9"):
        out = tmp_path / f"tau-{thr}.json"
        eval_main(["--target", random_target_dir, "--draft", str(tmp_path / "full" / "export"), "--prompts",
                   "mtbench", "--num-prompts", "2", "--max-new-tokens", "12", "--out", str(out),
                   "--proposer-option", f"confidence_threshold={thr}"])
        got = json.loads(out.read_text())
        assert got["summary"]["lossless_prompts"] == 2 and got["summary"]["num_draft_tokens"] == 4
        assert got["proposer_options"] == {"confidence_threshold": float(thr)}
        taus[thr] = got
    # a high threshold proposes fewer tokens per round than none
    proposed = {thr: sum(sum(p["proposed"]) for p in r["prompts"]) for thr, r in taus.items()}
    assert proposed["0.9"] < proposed["0"], proposed


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
    assert info["world_size"] == 2 and f8["converted"] == 14, f8  # 2 layers x q k v o gate up down
    for name in ("fc", "markov_head.markov_w2", "confidence_head.proj"):
        assert f8["skipped"][name].startswith("kept"), (name, f8["skipped"])
    tensors, _ = load_export(str(tmp_path / "export"))
    assert all(not any(b in k for b in BAD_FRAGMENTS) for k in tensors)
