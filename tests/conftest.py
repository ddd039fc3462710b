"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def random_target_dir(tmp_path_factory) -> str:
    """A random-weight debugmodel Qwen3 target written as an HF folder (what
    scripts/write_random_target.py writes for the default job), once per test session."""
    from titan_draft.components.target import write_random_target

    return write_random_target(str(tmp_path_factory.mktemp("targets") / "qwen3_debug"))
