"""DSpark's training step as it runs on a GPU (compiled layers, flex attention over the anchors'
tile BlockMask, the compiled chunk statistics of the distillation, the spans copied behind an
event) against its definition's float64 reference (tests/dspark_reference.py, on the CPU).
The CPU test of the same pieces (tests/unit/models/dspark/test_models_dspark_definition.py) runs
the dense-mask sdpa path and the eager statistics. Skipped without CUDA."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from dspark_reference import (
    ARGS,
    make_anchors,
    make_draft,
    make_features,
    reference_step,
)

from titan_draft.protocols import TargetFeatures

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def ieee_fp32():
    """fp32 matmuls without TF32, so that fp32 is compared with fp64 at fp32's precision."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def run_step(ref, f: TargetFeatures, anchors, keep, device: torch.device, backend: str, compile_layers: bool):
    """``ref``'s parameters in fp32 on ``device``: (loss / denominator, denominator, {name: grad})."""
    d = copy.deepcopy(ref).float().to(device)
    d.args = replace(d.args, attn_backend=backend)
    if compile_layers:
        for layer in d.layers.values():
            layer.compile()
    on = TargetFeatures(input_ids=f.input_ids.to(device), loss_mask=f.loss_mask.to(device),
                        valid_lengths=f.valid_lengths.to(device), aux_hidden=f.aux_hidden.float().to(device),
                        last_hidden=f.last_hidden.float().to(device))
    out = d.forward_with_anchors(on, anchors.to(device), keep.to(device))
    loss = out.loss_sum / out.loss_denominator
    loss.backward()
    return loss.item(), out.loss_denominator.item(), {n: p.grad.double().cpu() for n, p in d.named_parameters()}


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_cuda_step_equals_the_definition(kind, ieee_fp32):
    # head_dim 16: flex attention's compiled kernel takes no smaller head (the CPU test runs 8)
    args = replace(ARGS, markov_head_type=kind, head_dim=16)
    ref = make_draft(args)
    f = make_features()
    anchors, keep = make_anchors(f)
    loss, den, grads = run_step(ref, f, anchors, keep, torch.device("cuda"), "flex", compile_layers=True)
    want, wsum, _, _ = reference_step(ref, f, anchors, keep)
    want.backward()
    assert den == pytest.approx(wsum, rel=1e-6)
    assert loss == pytest.approx(want.item(), rel=2e-3)
    for name, p in ref.named_parameters():
        scale = float(p.grad.abs().max())
        torch.testing.assert_close(grads[name], p.grad, rtol=2e-2, atol=2e-3 * scale, msg=name)
