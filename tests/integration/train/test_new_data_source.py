"""The data-source contract: sources defined here, in a test file, register with the data-source
registry and feed the unchanged engine (the trainer, the start-up check, the held-out split, the
eval prompts)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torchdata.nodes as tn

from titan_draft.train import main as cli_main
from titan_draft.config import ConfigManager
from titan_draft.data.chat.format import build_chat_format
from titan_draft.data.chat.prompts import load_eval_prompts
from titan_draft.data.chat.template import render_chat
from titan_draft.data.pipeline import build_chat_loader, build_rows_loader, chat_samples
from titan_draft.data.sources import DataSource, register_data_source
from titan_draft.data.sources.rows import normalize_row, split_rows
from titan_draft.data.tokenizer import build_tokenizer
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.train import Trainer
from helpers import REPO

# Conversations the "inline" source serves: row i asks question i and gets answer i.
ROWS = [{"conversations": [{"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
                           {"from": "gpt", "value": f"It is {2 * i}, since {i} and {i} make {2 * i}."}]}
        for i in range(24)]
CHECKED: list[str] = []


def _inline_check(source: str) -> None:
    CHECKED.append(source)
    if source == "inline:missing":
        raise ValueError("data.source: 'inline:missing' names no inline table")


INLINE = DataSource(name="inline_test", claims=lambda s: s.startswith("inline:"), build_loader=build_chat_loader,
                    samples=chat_samples, rows=lambda s: iter(ROWS), check=_inline_check, probe_at_start=True)


class _CountingNode(tn.BaseNode):
    """Token rows [k, k+1, ...] of growing length: a source that makes its samples itself."""

    def __init__(self, max_length: int):
        super().__init__()
        self.max_length, self.k = max_length, 0

    def reset(self, initial_state=None):
        super().reset(initial_state)
        self.k = 0 if initial_state is None else initial_state["chat_source"]["position"]

    def next(self):
        n = 8 + self.k % 8
        ids = [(self.k + j) % 1000 + 10 for j in range(n)]
        self.k += 1
        return ids, [False] * 2 + [True] * (n - 2)

    def get_state(self):
        return {"chat_source": {"epoch": 0, "position": self.k, "skip_counts": {}, "num_rows": 1000}}

    rows = range(1000)  # what the loader counts as this rank's rows


COUNTING = DataSource(name="counting_test", claims=lambda s: s == "counting",
                      build_loader=lambda ctx: build_rows_loader(_CountingNode(ctx.data.max_length), ctx))


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_data_source(INLINE)
    register_data_source(COUNTING)


def _argv(dump, target: str, source: str, *extra: str) -> list[str]:
    return ["--job.config_file", f"{REPO}/train_configs/debug_random.toml", "--job.dump_folder", str(dump),
            "--target.path", target, "--data.source", source, "--data.max_length", "64", "--data.shuffle", "false",
            "--training.steps", "2", "--training.local_batch_size", "2", "--checkpoint.enable", "false",
            "--checkpoint.export", "false", "--metrics.enable_tensorboard", "false",
            "--profiling.enable_profiling", "false", *extra]


def _first_batches(argv: list[str], n: int):
    trainer = Trainer(ConfigManager().parse_args(argv))
    try:
        batches = list(itertools.islice(iter(trainer.dataloader), n))
        losses = trainer.train()
        return trainer, batches, losses
    finally:
        trainer.close()
        destroy_distributed()


def test_a_conversation_source_feeds_the_trainer_held_out_split_and_eval(tmp_path, random_target_dir):
    trainer, batches, losses = _first_batches(_argv(tmp_path, random_target_dir, "inline:chat",
                                                    "--data.holdout_rows", "4"), 2)
    assert sorted(losses) == [1, 2] and all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    tok = trainer.tokenizer
    # the batches are the source's rows after the 4 held-out ones, in order, rendered by the run's format
    for b, batch in enumerate(batches):
        for i in range(2):
            ids, mask = render_chat(normalize_row(ROWS[4 + 2 * b + i]), tok, trainer.chat.template,
                                    trainer.chat.system_prompt, enable_thinking=trainer.chat.enable_thinking)
            n = int(batch["valid_lengths"][i])
            assert batch["input_ids"][i, :n].tolist() == ids and batch["loss_mask"][i, :n].tolist() == mask
    # the held-out split and the eval's 'holdout' prompts read the same source through the registry
    assert split_rows("inline:chat", skip_rows=4).rows == ROWS[4:]
    prompts = load_eval_prompts(["holdout"], tok, template=trainer.chat.template, system_prompt="",
                                enable_thinking=False, num_prompts=0, data_source="inline:chat", holdout_rows=4)
    assert [p.name for p in prompts] == [f"holdout:{i}" for i in range(4)]
    assert "Question number 3" in tok.decode(prompts[3].ids)


def test_a_source_of_its_own_token_rows_feeds_the_trainer(tmp_path, random_target_dir):
    _, batches, losses = _first_batches(_argv(tmp_path, random_target_dir, "counting"), 2)
    assert sorted(losses) == [1, 2]
    assert batches[0]["input_ids"][0, :8].tolist() == [10 + j for j in range(8)]
    assert batches[1]["valid_lengths"].tolist() == [10, 11] and batches[0]["input_ids"].shape[1] == 64


def test_the_sources_own_check_runs_before_anything_loads(tmp_path, random_target_dir, capsys):
    CHECKED.clear()
    with pytest.raises(SystemExit) as e:
        cli_main(_argv(tmp_path, random_target_dir, "inline:missing"))
    assert e.value.code == 2 and CHECKED == ["inline:missing"]
    assert "titan_draft: error: data.source: 'inline:missing' names no inline table" in capsys.readouterr().err


def test_epoch_samples_of_a_registered_source_render_as_training():
    from titan_draft.data.pipeline import epoch_samples

    cfg = ConfigManager().parse_args(["--data.source", "inline:x", "--data.max_length", "64",
                                      "--data.chat_template", "chatml"])
    tok = build_tokenizer("qwen3")
    chat = build_chat_format(cfg.data, tok)
    samples = list(epoch_samples(cfg.data, tok, chat=chat, dp_rank=1, dp_world=2, seed=0))
    assert len(samples) == len(ROWS) // 2
    assert samples[0] == render_chat(normalize_row(ROWS[1]), tok, "chatml", chat.system_prompt)
