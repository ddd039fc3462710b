"""A draft trains against the Qwen2 and Qwen3-MoE target families on CPU, in each family's chat
format, and decodes losslessly against it (speculative output = the target's greedy output)."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from helpers import debug_job_argv

from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.eval import main as eval_main
from titan_draft.train import Trainer

QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5's behaviour without tools, written for this test: a default system turn when the
# conversation has none, then ChatML
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}<|im_start|>system\n" + QWEN25_SYSTEM + "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _qwen25_tokenizer():
    """Qwen's BPE with Qwen2.5's special tokens (no <think> tokens: those came with Qwen3)."""
    import tiktoken

    from titan_draft.data.tokenizer import Tokenizer, build_tokenizer

    qwen3 = build_tokenizer("qwen3")
    enc = qwen3.encoding
    specials = {t: i for t, i in qwen3.special_tokens.items() if i <= qwen3.token_id("<|file_sep|>")}
    enc = tiktoken.Encoding(name="qwen2.5-test", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                            special_tokens=specials)
    return Tokenizer("qwen2.5-test", enc, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                     chat_template=QWEN25_TEMPLATE)


@pytest.fixture(scope="module")
def native_targets(tmp_path_factory) -> dict[str, str]:
    """Random-weight debug targets of both families as HF folders with their tokenizers."""
    from titan_draft.data.tokenizer import build_tokenizer
    from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer
    from titan_draft.protocols.target_spec import get_target_spec

    root = tmp_path_factory.mktemp("native_targets")
    folders = {}
    for family, tokenizer in (("qwen2", _qwen25_tokenizer()), ("qwen3_moe", build_tokenizer("qwen3"))):
        spec = get_target_spec(family)
        args = replace(spec.flavors["debugmodel"], num_hidden_layers=4)
        model = spec.model_cls(args)
        model.init_weights(seed=7)
        folder = root / family
        spec.save_hf_checkpoint(model, str(folder), dtype=torch.float32)
        save_hf_tokenizer(tokenizer, str(folder))
        (folder / "config.json").write_text(json.dumps(args.to_hf_config("float32")))
        folders[family] = str(folder)
    return folders


@pytest.mark.parametrize("family, template", [("qwen2", "chatml"), ("qwen3_moe", "qwen3")])
def test_draft_trains_and_decodes_losslessly(tmp_path, chat_jsonl, native_targets, family, template):
    folder = native_targets[family]
    argv = debug_job_argv("dflash2", tmp_path, folder, chat_jsonl, "--data.max_rows", "0",
                          "--training.local_batch_size", "2", "--training.steps", "2", "--checkpoint.enable", "false",
                          "--data.system_prompt", "auto", max_length=96)
    cfg = ConfigManager().parse_args(argv)
    trainer = Trainer(cfg)
    try:
        assert trainer.target.family == family and trainer.run_info["chat_template"] == template
        batch = next(iter(trainer.dataloader))
        ids, mask = batch["input_ids"][0], batch["loss_mask"][0]
        text = trainer.tokenizer.decode(ids[: int(batch["valid_lengths"][0])].tolist())
        if family == "qwen2":  # Qwen2.5's default system turn, read from the folder's template
            head = f"<|im_start|>system\n{QWEN25_SYSTEM}<|im_end|>\n<|im_start|>user\n"
            assert text.startswith(head)
            n_head = len(trainer.tokenizer.encode(head))
            assert not mask[:n_head].any() and mask.any()  # the prompt is never trained on
        losses = trainer.train()
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses.values())
    finally:
        trainer.close()
        destroy_distributed()
    out = tmp_path / "tau.json"
    eval_main(["--target", folder, "--draft", str(tmp_path / "export"), "--prompts", "mtbench",
               "--num-prompts", "2", "--max-new-tokens", "12", "--out", str(out)])
    summary = json.loads(out.read_text())["summary"]
    assert summary["lossless_prompts"] == 2
