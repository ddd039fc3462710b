"""A draft trains against families only target.backend = "transformers" runs (Gemma2, Mistral)
on CPU, and decodes losslessly against them (speculative output = the target's greedy output)."""

from __future__ import annotations

import json
import math

import pytest
from helpers import debug_job_argv
from hf_folders import HF_ONLY_FAMILIES, write_hf_only_chat_target

from scripts import first_token
from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.eval import main as eval_main
from titan_draft.train import Trainer

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_targets(tmp_path_factory) -> dict[str, str]:
    """Random-weight folders with their own tokenizer and chat template."""
    root = tmp_path_factory.mktemp("hf_targets")
    return {family: write_hf_only_chat_target(root / family, family) for family in HF_ONLY_FAMILIES}


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
        assert trainer.target.args.model_type == family and trainer.run_info["chat_template"] == "jinja"
        batch = next(iter(trainer.dataloader))
        ids, mask = batch["input_ids"][0], batch["loss_mask"][0]
        text = trainer.tokenizer.decode(ids[: int(batch["valid_lengths"][0])].tolist())
        assert text.startswith("<turn ") and "<turn model>\n" in text
        n_head = len(trainer.tokenizer.encode(text[: text.index("<turn model>\n") + len("<turn model>\n")]))
        assert not mask[:n_head].any() and mask.any()  # the prompt is never trained on
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
    # so do the scripts that read a draft along the target's decodes (run natively, the folder is refused)
    read = first_token.main(["--target", folder, "--draft", str(tmp_path / "export"), "--num-prompts", "1",
                             "--max-new-tokens", "4", "--contexts", "0", "--device", "cpu"])
    assert read["contexts"]["0"]["positions"] > 0
