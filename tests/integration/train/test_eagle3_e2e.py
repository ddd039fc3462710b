"""EAGLE-3 through the real trainer on CPU: its vocabulary pass, exact resume, export and the
true-τ eval. Two gloo ranks with float8 + compile + FSDP2: tests/integration/distributed/test_two_rank_float8.py."""

from __future__ import annotations

import json
from functools import partial

import pytest
import torch
from safetensors import safe_open

from models.eagle3.vocab import count_loss_tokens
from titan_draft.checkpoint.export import load_export
from titan_draft.config import ConfigManager
from titan_draft.data.pipeline import epoch_samples
from titan_draft.data.tokenizer import build_tokenizer
from titan_draft.eval import main as eval_main
from helpers import check_exact_resume, debug_job_argv, run_training

BAD_FRAGMENTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp", "embed", "target_lm_head")
_args = partial(debug_job_argv, "eagle3")  # (dump, target, data, *extra)


def test_trains_resumes_exports_and_decodes(tmp_path, random_target_dir, chat_jsonl):
    common = ("--training.steps", "6", "--checkpoint.interval", "3")
    check_exact_resume(lambda dump: _args(dump, random_target_dir, chat_jsonl, *common), tmp_path)

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
