"""A draft trains against families only target.backend = "transformers" runs (Gemma2, Mistral)
on CPU, and decodes losslessly against them (speculative output = the target's greedy output)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import HF_ONLY_FAMILIES, debug_job_argv, write_hf_only_target

from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.eval import main as eval_main
from titan_draft.train import Trainer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_targets(tmp_path_factory) -> dict[str, str]:
    """Random-weight folders with the packaged Qwen BPE as their tokenizer (the vocab is its size)."""
    from titan_draft.data.tokenizer import build_tokenizer
    from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer

    tokenizer = build_tokenizer("qwen3")
    root = tmp_path_factory.mktemp("hf_targets")
    folders = {}
    for family in HF_ONLY_FAMILIES:
        folder = write_hf_only_target(root / family, family, vocab_size=tokenizer.n_vocab, num_layers=4,
                                      max_shard_size="2GB")
        save_hf_tokenizer(tokenizer, folder)
        folders[family] = folder
    return folders


@pytest.mark.parametrize("family", sorted(HF_ONLY_FAMILIES))
def test_draft_trains_and_decodes_losslessly(tmp_path, chat_jsonl, hf_targets, family):
    folder = hf_targets[family]
    argv = debug_job_argv("dflash2", tmp_path, folder, chat_jsonl, "--target.backend", "transformers",
                          "--data.max_rows", "0", "--training.local_batch_size", "2", "--training.steps", "2",
                          "--checkpoint.enable", "false", max_length=64)
    cfg = ConfigManager().parse_args(argv)
    trainer = Trainer(cfg)
    try:
        assert trainer.target.family == "transformers" and trainer.run_info["target_backend"] == "transformers"
        assert trainer.target.args.model_type == family
        losses = trainer.train()
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses.values())
    finally:
        trainer.close()
        destroy_distributed()
    out = tmp_path / "tau.json"
    # the backend comes from the run's record: the eval reads the folder through transformers too
    eval_main(["--target", folder, "--draft", str(tmp_path / "export"), "--prompts", "mtbench",
               "--num-prompts", "2", "--max-new-tokens", "12", "--out", str(out)])
    summary = json.loads(out.read_text())["summary"]
    assert summary["lossless_prompts"] == 2
