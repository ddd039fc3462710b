"""What the tests of scripts/compare_drafts.py share."""

from __future__ import annotations

import pytest


@pytest.fixture
def job(random_target_dir, chat_jsonl) -> list[str]:
    """The target and data every job of a comparison shares (``--target T --data D``)."""
    return ["--target", random_target_dir, "--data", chat_jsonl]
