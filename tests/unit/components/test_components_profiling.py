"""Profiling: Chrome traces at the scheduled iterations (also after a resume); CPU no-ops."""

import json
import logging
import os

import pytest
import torch

from titan_draft.components.profiling import maybe_enable_memory_snapshot, maybe_enable_profiling
from titan_draft.config.job_config import Profiling

CFG = Profiling(enable_profiling=True, profile_freq=3, profile_warmup=1, profile_active=1,
                save_traces_folder="traces")


def _steps(prof, n):
    x = torch.randn(16, 16)
    for _ in range(n):
        x = torch.tanh(x @ x)
        prof.step()


def test_trace_written_as_chrome_json(tmp_path):
    with maybe_enable_profiling(CFG, str(tmp_path), global_step=0, rank=1) as prof:
        assert prof is not None
        _steps(prof, 3)
    assert os.listdir(tmp_path / "traces") == ["iteration_3"]
    path = tmp_path / "traces" / "iteration_3" / "rank1_trace.json"
    with open(path) as f:
        trace = json.load(f)
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    assert any("mm" in str(e.get("name", "")) for e in trace["traceEvents"])


def test_resume_keeps_the_schedule(tmp_path):
    with maybe_enable_profiling(CFG, str(tmp_path), global_step=4, rank=0) as prof:
        _steps(prof, 2)  # steps 5 and 6
    assert os.listdir(tmp_path / "traces") == ["iteration_6"]


def test_disabled_and_bad_config(tmp_path, caplog):
    with maybe_enable_profiling(Profiling(), str(tmp_path)) as prof:
        assert prof is None
    with pytest.raises(ValueError, match="profiling.profile_freq"):
        with maybe_enable_profiling(Profiling(enable_profiling=True, profile_freq=2), str(tmp_path)):
            pass
    cfg = Profiling(enable_memory_snapshot=True)
    with caplog.at_level(logging.INFO, logger="titan_draft.components.profiling"):
        with maybe_enable_memory_snapshot(cfg, str(tmp_path), device_type="cpu") as snap:
            assert snap is None
    assert "CUDA only" in caplog.text
    assert os.listdir(tmp_path) == []
