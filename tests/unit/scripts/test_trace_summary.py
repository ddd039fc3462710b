"""scripts/trace_summary.py on hand-made Chrome traces: busy time, categories, the GPU's idle
time charged to the host op under each gap, kernels charged to their innermost launching op,
blocking calls and named regions."""

from __future__ import annotations

import os
import sys

from helpers import REPO


def _trace_summary():
    """scripts/trace_summary.py as a module (scripts/ is not a package path)."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import trace_summary
    finally:
        sys.path.pop(0)
    return trace_summary


def test_trace_summary_busy_time_and_categories():
    """scripts/trace_summary.py: overlapping kernels count once in busy time; kernels land in
    their categories; blocking runtime calls are counted."""
    trace_summary = _trace_summary()
    ev = lambda name, cat, ts, dur: {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}  # noqa: E731
    trace = {"traceEvents": [
        ev("ProfilerStep#1", "user_annotation", 0, 1000),
        ev("nvjet_sm90_tst_320x128_TNT", "kernel", 0, 300),
        ev("triton_tem_fused_flex_attention_backward", "kernel", 200, 200),  # overlaps by 100
        ev("multi_tensor_apply_kernel<FusedOptimizer>", "kernel", 600, 100),
        ev("cudaStreamSynchronize", "cuda_runtime", 700, 5),
    ]}
    text = trace_summary.summarize(trace, top=5)
    assert "wall 1.0 ms, GPU busy 0.5 ms (50.0%), kernels 3" in text
    assert "matmul" in text and "attention" in text and "optimizer" in text
    assert trace_summary.category("triton_tem_fused_flex_attention_backward") == "attention"
    assert trace_summary.category("nvjet_sm90_tst_320x128") == "matmul"
    assert "cudaStreamSynchronize x1 0.0 ms" in text


def _event(name, cat, ts, dur, tid=1, **args):
    """One complete ("X") event of a torch profiler trace, on thread ``tid`` of process 0."""
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def test_trace_summary_charges_gpu_idle_time_to_the_host_op_under_each_gap():
    """Inside the profiled step, each gap between kernels goes to the innermost host op spanning
    its middle on the thread that launched the kernel after it; time outside the steps is not
    counted, and a blocking call's host time is summed."""
    trace_summary = _trace_summary()

    trace = {"traceEvents": [
        _event("ProfilerStep#3", "user_annotation", 0, 1000),
        _event("aten::item", "cpu_op", 100, 200),
        _event("cudaStreamSynchronize", "cuda_runtime", 110, 40),
        _event("Optimizer.step#AdamW.step", "user_annotation", 400, 300),
        _event("aten::_foreach_add_", "cpu_op", 450, 200, **{"Input Dims": [[8], [8]]}),
        _event("cudaLaunchKernel", "cuda_runtime", 290, 5, correlation=2),
        _event("cudaLaunchKernel", "cuda_runtime", 690, 5, correlation=3),
        _event("k1", "kernel", 0, 100, tid=7, correlation=1),
        _event("k2", "kernel", 300, 100, tid=7, correlation=2),
        _event("k3", "kernel", 700, 300, tid=7, correlation=3),
        _event("k4", "kernel", 1500, 10, tid=7, correlation=4),  # after the step: its gap is not counted
    ]}
    text = trace_summary.summarize(trace, top=5)
    gaps = text.split("GPU idle inside the profiled steps: ")[1].split("host runtime calls")[0]
    lines = [" ".join(line.split()) for line in gaps.strip().splitlines()]
    assert lines[0].startswith("0.5 ms")
    assert lines[1:] == ["0.3 ms 1x aten::_foreach_add_ [[8], [8]]", "0.2 ms 1x aten::item"]
    assert "cudaStreamSynchronize x1 0.0 ms" in text


def test_trace_summary_charges_kernels_to_the_innermost_launching_op():
    """Each kernel's GPU time goes to the innermost host op around its launch on the launching
    thread (matched by correlation id), labelled with its input shapes; a launch outside every
    op is counted apart."""
    trace_summary = _trace_summary()

    trace = {"traceEvents": [
        _event("aten::linear", "cpu_op", 0, 100, **{"Input Dims": [[4, 8], [16, 8], []]}),
        _event("aten::mm", "cpu_op", 10, 50, **{"Input Dims": [[4, 8], [8, 16]]}),
        _event("cudaLaunchKernel", "cuda_runtime", 20, 2, correlation=1),  # inside aten::mm
        _event("cudaLaunchKernel", "cuda_runtime", 80, 2, correlation=2),  # after mm, inside linear
        _event("aten::_log_softmax_backward_data", "cpu_op", 0, 40, tid=2, **{"Input Dims": [[4, 16], [4, 16]]}),
        _event("cudaLaunchKernel", "cuda_runtime", 5, 2, tid=2, correlation=3),  # the backward thread
        _event("cudaLaunchKernel", "cuda_runtime", 500, 2, correlation=4),  # no op around it
        _event("nvjet_gemm", "kernel", 100, 30, tid=7, correlation=1),
        _event("add_kernel", "kernel", 130, 5, tid=7, correlation=2),
        _event("softmax_bwd", "kernel", 140, 20, tid=7, correlation=3),
        _event("memset", "kernel", 600, 1, tid=7, correlation=4),
    ]}
    text = trace_summary.summarize(trace, top=10)
    ops = text.split("launching host ops")[1].split("host runtime calls")[0]
    assert "0.0 ms     1x  aten::mm [[4, 8], [8, 16]]" in ops
    assert "aten::linear [[4, 8], [16, 8]]" in ops
    assert "aten::_log_softmax_backward_data [[4, 16], [4, 16]]" in ops
    assert "(no host op)" in ops
    # ordered by GPU time: the mm's 30 us first, then the backward's 20
    assert ops.index("aten::mm") < ops.index("_log_softmax_backward_data") < ops.index("aten::linear")
    # the mm's 2 * 4 * 8 * 16 FLOP in its kernel's 30 us; no warning without a peak, one above it
    assert "aten::mm [[4, 8], [8, 16]]  [0 TFLOP/s]" in ops and "WARNING" not in text
    assert trace_summary.gemm_flops({"name": "aten::mm", "args": {"Input Dims": [[4, 8], [8, 16]]}}) == 1024
    assert trace_summary.gemm_flops({"name": "aten::addmm", "args": {"Input Dims": [[16], [4, 8], [8, 16]]}}) == 1024
    assert trace_summary.gemm_flops({"name": "aten::bmm", "args": {"Input Dims": [[3, 4, 8], [3, 8, 16]]}}) == 3072
    assert trace_summary.gemm_flops({"name": "aten::add", "args": {"Input Dims": [[4, 8], [4, 8]]}}) is None
    slow = trace_summary.summarize(trace, top=10, peak_tflops=1e-5)  # 1024 FLOP / 30 us = 3.4e-5
    assert "WARNING: 1 GEMM op(s) imply more than the peak" in slow and "aten::mm [[4, 8], [8, 16]]" in slow
    assert "WARNING" not in trace_summary.summarize(trace, top=10, peak_tflops=1e-4)
    # a float8 GEMM is held to twice the peak: the same rate warns only below half of it
    trace["traceEvents"][1]["name"] = "aten::_scaled_mm"
    assert "WARNING" not in trace_summary.summarize(trace, top=10, peak_tflops=2e-5)
    assert "WARNING: 1 GEMM" in trace_summary.summarize(trace, top=10, peak_tflops=1.6e-5)


def test_trace_summary_names_the_ops_that_issue_blocking_calls():
    """Blocking runtime calls (copies, synchronizes) are totalled by name and then charged to the
    innermost host op around them, ordered by the host time spent in them."""
    trace_summary = _trace_summary()

    trace = {"traceEvents": [
        _event("aten::item", "cpu_op", 0, 900),
        _event("aten::_local_scalar_dense", "cpu_op", 5, 890),
        _event("cudaMemcpyAsync", "cuda_runtime", 10, 800, correlation=1),  # waited 0.8 ms in .item()
        _event("aten::copy_", "cpu_op", 1000, 300, **{"Input Dims": [[2, 7], [2, 7]]}),
        _event("cudaMemcpyAsync", "cuda_runtime", 1010, 100, correlation=2),
        _event("aten::copy_", "cpu_op", 1400, 300, **{"Input Dims": [[2, 7], [2, 7]]}),
        _event("cudaMemcpyAsync", "cuda_runtime", 1410, 150, correlation=3),
        _event("cudaStreamSynchronize", "cuda_runtime", 2000, 50, correlation=4),  # outside every op
        _event("cudaLaunchKernel", "cuda_runtime", 2100, 2, correlation=5),  # not a blocking call
        _event("k", "kernel", 2200, 10, tid=7, correlation=5),
    ]}
    text = trace_summary.summarize(trace, top=5).split("host runtime calls that can block")[1]
    assert "cudaMemcpyAsync x3 1.1 ms" in text and "cudaStreamSynchronize x1 0.1 ms" in text
    callers = [line.strip() for line in text.split("issued them")[1].splitlines()[1:]]
    assert callers[0].startswith("0.8 ms     1x  cudaMemcpyAsync in aten::_local_scalar_dense")
    assert callers[1].startswith("0.2 ms     2x  cudaMemcpyAsync in aten::copy_ [[2, 7], [2, 7]]")
    assert callers[2].startswith("0.1 ms     1x  cudaStreamSynchronize in (no host op)")
    assert len(callers) == 3  # the kernel launch is not a blocking call


def test_trace_summary_named_regions():
    """Per region the trainer names: host time, GPU span, and only the kernel time inside the span
    (overlaps counted once; a kernel straddling the span's end counts up to it)."""
    trace_summary = _trace_summary()
    ev = lambda name, cat, ts, dur: {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur}  # noqa: E731
    trace = {"traceEvents": [
        ev("titan_draft.features", "user_annotation", 0, 400),
        ev("titan_draft.features", "gpu_user_annotation", 100, 1000),
        ev("titan_draft.backward", "user_annotation", 400, 50),
        ev("titan_draft.backward", "gpu_user_annotation", 2000, 500),
        ev("other_annotation", "gpu_user_annotation", 0, 5000),
        ev("k1", "kernel", 100, 200),
        ev("k2", "kernel", 250, 100),  # overlaps k1 by 50
        ev("k3", "kernel", 850, 300),  # 250 of it inside the features span
        ev("k4", "kernel", 2100, 400),
    ]}
    regions = trace_summary.summarize(trace, top=5).split("named regions")[1].split("host runtime")[0]
    lines = [" ".join(line.split()) for line in regions.strip().splitlines()[1:]]
    # by GPU span; k1 + k2 count 250 us once, k3 up to the span's end
    assert lines == ["features host 0.4 ms GPU span 1.0 ms kernels 0.5 ms",
                     "backward host 0.1 ms GPU span 0.5 ms kernels 0.4 ms"]
    assert "other_annotation" not in regions
    assert "named regions" not in trace_summary.summarize({"traceEvents": trace["traceEvents"][5:]}, top=5)
