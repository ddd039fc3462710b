"""The spawn helper the gloo tests use: only a rank killed by a signal is retried, once, and the
warning (or the error) carries the stacks faulthandler wrote at the abort."""

from __future__ import annotations

import os

import pytest
from torch.multiprocessing.spawn import ProcessRaisedException

from helpers import spawn_ranks


def _abort_in_named_frame():
    os.abort()


def _worker(rank: int, port: int, folder: str, mode: str) -> None:
    attempt = len(os.listdir(folder)) + 1
    with open(os.path.join(folder, f"attempt{attempt}-port{port}"), "w"):
        pass
    if mode == "raise":
        raise ValueError("a Python error in the rank")
    if mode == "always" or (mode == "first" and attempt == 1):
        _abort_in_named_frame()


def test_an_abort_once_is_retried_with_a_fresh_port_and_warned(tmp_path):
    with pytest.warns(UserWarning, match="SIGABRT") as record:
        spawn_ranks(_worker, str(tmp_path), "first", nprocs=1)
    attempts = sorted(os.listdir(tmp_path))
    assert len(attempts) == 2 and attempts[0].split("-port")[1] != attempts[1].split("-port")[1]
    message = str(record[0].message)
    assert "attempt 1 of 2" in message and "_abort_in_named_frame" in message  # the rank's stack


def test_an_abort_every_time_fails_with_the_stacks(tmp_path):
    with pytest.raises(RuntimeError, match="attempt 2 of 2") as info, pytest.warns(UserWarning):
        spawn_ranks(_worker, str(tmp_path), "always", nprocs=1)
    assert "_abort_in_named_frame" in str(info.value)
    assert len(os.listdir(tmp_path)) == 2


def test_a_python_error_is_not_retried(tmp_path):
    with pytest.raises(ProcessRaisedException, match="a Python error in the rank"):
        spawn_ranks(_worker, str(tmp_path), "raise", nprocs=1)
    assert len(os.listdir(tmp_path)) == 1
