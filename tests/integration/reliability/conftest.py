"""The reliability tests' guard that fails a test if the trainer (the process group, the target)
starts before the job was checked."""

from __future__ import annotations

import pytest

import titan_draft.train as train_module


@pytest.fixture
def no_trainer(monkeypatch):
    """Fails the test if main() gets as far as building the Trainer (i.e. loading the target)."""

    def refuse(cfg):
        raise AssertionError("the target started loading before the job was checked")

    monkeypatch.setattr(train_module, "Trainer", refuse)

