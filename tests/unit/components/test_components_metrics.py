"""MetricsLogger: cadence, console line contents, TensorBoard scalars, peak-FLOPs table."""

import glob
import logging

import pytest

from titan_draft.components.metrics import DeviceMemoryMonitor, MetricsLogger, get_peak_flops
from titan_draft.config.job_config import Metrics


def test_should_log_cadence(tmp_path):
    m = MetricsLogger(Metrics(log_freq=5, enable_tensorboard=False), str(tmp_path), 0, "cpu")
    assert [s for s in range(1, 13) if m.should_log(s, total_steps=12)] == [1, 5, 10, 12]
    assert [s for s in range(1, 13) if m.should_log(s)] == [1, 5, 10]


def test_console_line_and_tensorboard(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    m = MetricsLogger(Metrics(log_freq=10), str(tmp_path), 0, "cpu")
    scalars = {
        "loss": 1.23456, "acc": 0.5, "accept_len": 2.75, "lr": 3e-4, "grad_norm": 0.875,
        "tokens_per_s": 12345.0, "samples_per_s": 6.25, "mfu": 40.0, "data_wait_s": 0.012,
        "step_time_s": 0.12, "acc_3": 0.125, "anchor_fill": 0.354,
    }
    with caplog.at_level(logging.INFO, logger="titan_draft.components.metrics"):
        line = m.log(10, scalars, total_steps=100)
    assert line in caplog.text
    for piece in ["step 10/100", "loss 1.2346", "acc 0.5000", "accept_len 2.750", "lr 3.000e-04",
                  "grad_norm 0.8750", "tok/s 12,345", "anchors 35%", "samples/s 6.25", "rss ", "data 12.0 ms (10.0%)",
                  "eta 0:00:11"]:
        assert piece in line, (piece, line)
    assert "mfu" not in line  # CPU: no meaningful peak
    plain = MetricsLogger(Metrics(log_freq=10, enable_tensorboard=False), str(tmp_path / "plain"), 0, "cpu")
    assert "anchors" not in plain.log(10, {"loss": 1.0}, total_steps=100)  # only when a draft reports it
    assert "acc_3" not in line  # extra metrics go to TensorBoard only
    m.close()

    (event_dir,) = glob.glob(str(tmp_path / "tb" / "*"))
    acc = EventAccumulator(event_dir)
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/acc", "train/acc_3", "optim/lr", "perf/tokens_per_s",
            "memory/rss_gib", "perf/data_wait_pct"} <= tags
    assert "perf/mfu" not in tags
    (event,) = acc.Scalars("train/loss")
    assert event.step == 10 and event.value == pytest.approx(1.23456)
    assert acc.Scalars("train/acc_3")[0].value == pytest.approx(0.125)


def test_non_zero_rank_is_silent(tmp_path):
    m = MetricsLogger(Metrics(), str(tmp_path), 1, "cpu")
    assert m.log(1, {"loss": 1.0}, total_steps=10) is None
    assert not (tmp_path / "tb").exists()


def test_peak_flops_table_and_cpu_memory():
    assert get_peak_flops("NVIDIA H200") == 989e12
    assert get_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert get_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert get_peak_flops("NVIDIA H20") == 148e12
    assert get_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert get_peak_flops("Some Future GPU") is None
    stats = DeviceMemoryMonitor("cpu").get_peak_stats()
    assert 0 < stats["rss_gib"] <= stats["peak_rss_gib"] + 1e-6
