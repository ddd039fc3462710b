"""The data pipeline's threads are stopped, and waited for, when a loader or trainer closes.

A prefetch thread still inside a torch call when the interpreter exits is killed there and aborts
the process; a 2-rank CPU run that had trained and saved died that way (SIGSEGV at exit) in CI."""

from __future__ import annotations

import json
import threading

from titan_draft.config import ConfigManager
from titan_draft.config.job_config import Data
from titan_draft.data.pipeline import build_dataloader
from titan_draft.data.tokenizer import build_tokenizer
from titan_draft.train import Trainer
from helpers import job_args


def _prefetch_threads() -> set[threading.Thread]:
    # torchdata's Prefetcher starts an unnamed Thread whose target is _populate_queue (Python
    # names such a thread "Thread-N (_populate_queue)")
    return {t for t in threading.enumerate() if t.is_alive() and "_populate_queue" in t.name}


def _rows(tmp_path, n=16) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"conversations": [{"from": "human", "value": f"q {i}"},
                                                          {"from": "gpt", "value": f"a {i}"}]}) + "\n"
                            for i in range(n)))
    return str(path)


def test_closing_a_loader_stops_its_prefetch_thread(tmp_path):
    before = _prefetch_threads()
    dl = build_dataloader(Data(source=_rows(tmp_path), max_length=64, chat_template="chatml", prefetch_factor=2),
                          build_tokenizer("qwen3"), dp_rank=0, dp_world=1, local_batch_size=2, seed=0,
                          static_shapes=False)
    next(dl)
    started = _prefetch_threads() - before
    assert len(started) == 1  # the thread runs ahead of the consumer
    dl.close()
    assert not any(t.is_alive() for t in started)
    dl.close()  # a second close is harmless


def test_a_closed_trainer_leaves_no_prefetch_thread(tmp_path, random_target_dir):
    before = _prefetch_threads()
    trainer = Trainer(ConfigManager().parse_args(job_args(
        tmp_path / "run", _rows(tmp_path), random_target_dir, "--training.steps", "1", "--data.prefetch_factor", "2",
        "--checkpoint.enable", "false", "--eval.enable", "false")))
    try:
        trainer.train()
        started = _prefetch_threads() - before
        assert started, "the job should run with a prefetch thread"
    finally:
        trainer.close()
    assert not any(t.is_alive() for t in started)
