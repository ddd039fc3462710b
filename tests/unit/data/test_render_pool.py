"""A counting pass rendered by forked processes (titan_draft/data/sources/render_pool.py) yields
exactly what one process yields, in source order, with unusable rows skipped alike."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from titan_draft.data.chat.format import build_chat_format
from titan_draft.data.sources.chat import ChatSourceNode
from titan_draft.data.sources.render_pool import default_render_workers, rendered_in_order


def _rows(n: int) -> list:
    rows = []
    for i in range(n):
        turns = [{"from": "human", "value": f"question {i} " * (1 + i % 5)},
                 {"from": "gpt", "value": f"answer {i}, é ü {i * 7}"}]
        if i % 7 == 3:
            turns = [{"from": "gpt", "value": "an answer alone"}]  # no question: usable, differently
        if i % 11 == 5:
            turns = []  # skipped: no conversation
        rows.append({"conversations": turns})
    return rows


def test_forked_rendering_equals_one_process(tok):
    chat = build_chat_format(SimpleNamespace(chat_template="chatml", system_prompt="", enable_thinking=True,
                                             last_turn_only=False), tok)
    node = ChatSourceNode(_rows(40), tok, chat=chat, max_length=24, seed=0, shuffle=True)
    serial = list(node.usable_samples(workers=1))
    forked = list(node.usable_samples(workers=2, chunk_rows=3))
    assert forked == serial and 0 < len(serial) < 40  # some rows skipped, the rest in source order


def _pid_of(row):
    return row, os.getpid()


@pytest.mark.parametrize("workers,chunk,forked", [(3, 2, True), (3, 4, False), (1, 1, False)])
def test_rows_go_to_workers_only_when_there_are_enough(workers, chunk, forked):
    """Rows are rendered in other processes where each worker gets at least two chunks, and come
    back in order either way."""
    node = SimpleNamespace(rows=list(range(12)), _sample=_pid_of)
    out = list(rendered_in_order(node, workers, chunk))
    assert [row for row, _ in out] == list(range(12))
    assert all((pid != os.getpid()) == forked for _, pid in out)


def test_default_workers_share_the_cores_among_the_ranks(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(32)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_render_workers() == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert default_render_workers() == 8  # at most 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0}, raising=False)
    assert default_render_workers() == 1


class _Logged:
    """A source node whose rows, wherever rendered, are logged to a file (one line each)."""

    def __init__(self, path, n):
        self.path, self.rows = str(path), list(range(n))

    def _sample(self, row):
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.write(fd, f"{row}\n".encode())
        os.close(fd)
        return row


def test_a_slow_reader_holds_a_few_chunks_not_the_source(tmp_path):
    import time

    node = _Logged(tmp_path / "rendered", 24)  # 12 chunks of 2 for 2 workers
    rows = rendered_in_order(node, 2, 2)
    assert next(rows) == 0
    time.sleep(1.0)  # the workers would render everything by now if nothing held them back
    assert len((tmp_path / "rendered").read_text().split()) <= (2 * 2 + 1) * 2
    assert [0, *rows] == list(range(24))
