"""A failure of any kind while the data thread prepares a row ends the run with that failure and
the row, never a hang."""

from __future__ import annotations

import json
import threading

import pytest

import titan_draft.data.sources.chat as source_node
from titan_draft.config.job_config import Data
from titan_draft.data.pipeline import build_dataloader
from titan_draft.data.worker_errors import DataRowError, DataWorkerError


class Panic(BaseException):
    """What a Rust tokenizer's panic is in Python: a BaseException, not an Exception."""


def _source(tmp_path, n=12, bad=7):
    rows = [{"conversations": [{"from": "human", "value": "PANIC" if i == bad else f"q {i}"},
                               {"from": "gpt", "value": f"a {i}"}]} for i in range(n)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _panic_on_marker(monkeypatch, exc):
    real = source_node.render_chat

    def render(turns, *args, **kwargs):
        if any("PANIC" in t.content for t in turns):
            raise exc
        return real(turns, *args, **kwargs)

    monkeypatch.setattr(source_node, "render_chat", render)


def _consume(dl, batches, timeout_s=30.0):
    """Read ``batches`` batches in another thread; the exception it ended with (a hang fails)."""
    result: dict = {}

    def work():
        try:
            for _ in range(batches):
                next(dl)
        except BaseException as e:  # noqa: BLE001
            result["error"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "the training loop is still waiting for a batch: the data thread died unreported"
    return result.get("error")


@pytest.mark.parametrize("prefetch", [2, 0])
@pytest.mark.parametrize("exc", [Panic("called `Result::unwrap()` on an `Err` value"), SystemExit(3), ValueError("bad")],
                         ids=["base_exception", "system_exit", "exception"])
def test_a_failing_row_ends_the_run_naming_the_row(tmp_path, tok, monkeypatch, prefetch, exc):
    _panic_on_marker(monkeypatch, exc)
    cfg = Data(source=_source(tmp_path), max_length=64, chat_template="chatml", shuffle=False,
               prefetch_factor=prefetch, holdout_rows=1)
    # DP rank 0 of 2 after one held-out row owns source rows 1, 3, 5, 7, ...: row 7 is its 4th
    dl = build_dataloader(cfg, tok, dp_rank=0, dp_world=2, local_batch_size=2, seed=0, static_shapes=False)
    error = _consume(dl, 20)
    assert isinstance(error, DataRowError), repr(error)
    line = str(error)
    assert line.startswith(f"data: row 7 (0-based) of data.source {cfg.source} could not be prepared: "
                           f"{type(exc).__name__}"), line
    assert "\n" not in line and error.__cause__ is exc


def test_any_other_failure_in_the_thread_is_forwarded(tmp_path, tok, monkeypatch):
    import titan_draft.data.pipeline as pipeline

    def broken_collate(samples, **kw):
        raise Panic("collate exploded")

    monkeypatch.setattr(pipeline, "collate_chat", broken_collate)
    cfg = Data(source=_source(tmp_path), max_length=64, chat_template="chatml", prefetch_factor=2)
    dl = build_dataloader(cfg, tok, dp_rank=0, dp_world=1, local_batch_size=2, seed=0, static_shapes=False)
    error = _consume(dl, 1)
    assert isinstance(error, DataWorkerError) and str(error) == "data: the data pipeline failed: Panic: collate exploded"
