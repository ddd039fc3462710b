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


# a family's own turn markers, no ChatML tokens: 'auto' renders with the folder's template. Gemma2's
# marks its answers ({% generation %}), Mistral's does not (the render-twice rule finds them).
TEMPLATE = (
    "{%- for m in messages %}{%- if m['role'] == 'assistant' %}<turn model>\n{% generation %}{{ m['content'] }}"
    "{{ eos_token }}{% endgeneration %}\n{%- else %}<turn {{ m['role'] }}>\n{{ m['content'] }}\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<turn model>\n{% endif %}"
)
TEMPLATES = {"gemma2": TEMPLATE,
             "mistral": TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")}


def _tokenizer(template: str):
    """The Qwen BPE cut to its first 4000 ranks (a small vocabulary keeps the run fast), with
    <|endoftext|> and <|im_end|> (the eos) as its only special tokens."""
    import tiktoken

    from titan_draft.data.tokenizer import Tokenizer, build_tokenizer

    qwen = build_tokenizer("qwen3")
    ranks = {b: r for b, r in qwen.encoding._mergeable_ranks.items() if r < 4000}
    enc = tiktoken.Encoding(name="hf-only-test", pat_str=qwen.encoding._pat_str, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": 4000, "<|im_end|>": 4001})
    return Tokenizer("hf-only-test", enc, pad_token="<|endoftext|>", eos_token="<|im_end|>", chat_template=template)


@pytest.fixture(scope="module")
def hf_targets(tmp_path_factory) -> dict[str, str]:
    """Random-weight folders with their own tokenizer and chat template."""
    from titan_draft.data.tokenizer.hf_save import save_hf_tokenizer

    root = tmp_path_factory.mktemp("hf_targets")
    folders = {}
    for family in HF_ONLY_FAMILIES:
        tokenizer = _tokenizer(TEMPLATES[family])
        folder = write_hf_only_target(root / family, family, vocab_size=tokenizer.n_vocab + 16, num_layers=4,
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
