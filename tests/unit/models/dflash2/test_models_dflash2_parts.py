"""models/dflash2's parts: the grouped dynamic convolution, the candidate selector, anchor
sampling, the training-progress ramp and the compute dtype."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from models.block_diffusion.layers import sample_anchors
from models.dflash2 import DFlash2Draft
from models.dflash2.conv import GroupedDynamicConv
from models.dflash2.selector import CandidateSelector
from test_models_dflash2 import ARGS, B, S, _conv, _features, _model


def test_conv_is_noop_at_init():
    f = _features()
    anchors, keep = sample_anchors(
        f.loss_mask, f.valid_lengths, ARGS.num_anchors, False, torch.Generator().manual_seed(1)
    )
    with_conv = _model(randomize=False)
    without = DFlash2Draft(replace(ARGS, conv_enabled=False)).double()
    missing, unexpected = without.load_state_dict(with_conv.state_dict(), strict=False)
    assert not missing and unexpected and all("conv" in k for k in unexpected)
    without.load_frozen_tables(with_conv.target_embed, with_conv.target_lm_head)
    h1, _ = with_conv.block_hidden(f, anchors, keep)
    h2, _ = without.block_hidden(f, anchors, keep)
    torch.testing.assert_close(h1, h2, rtol=0, atol=1e-13)


def test_conv_causal_within_block_and_never_across_blocks():
    torch.manual_seed(0)
    conv = GroupedDynamicConv(dim=16, taps=3, group_size=4, block_size=4).double()
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(1, 12, 16, dtype=torch.float64)  # three blocks of four rows
    n = torch.randn(1, 12, 16, dtype=torch.float64)
    d = conv.deltas(n)
    y = conv(x, d, 1)
    ref = torch.cat(
        [_conv(x[0, s : s + 4], conv.base_kernel[1], d[0, s : s + 4, 1], 4) for s in (0, 4, 8)]
    )
    torch.testing.assert_close(y[0], ref)
    x2 = x.clone()
    x2[:, 4:8] += 1.0  # perturb block 1
    y2 = conv(x2, d, 1)
    assert torch.equal(y2[:, 8:], y[:, 8:]) and torch.equal(y2[:, :4], y[:, :4])
    assert not torch.allclose(y2[:, 5], y[:, 5])
    x3 = x.clone()
    x3[:, 6] += 1.0  # a later row of the same block does not reach row 5
    assert torch.equal(conv(x3, d, 1)[:, 5], y[:, 5])


def test_selector_zero_successor_is_unary_and_bilinear_reference():
    torch.manual_seed(0)
    sel = CandidateSelector(dim=8, vocab_size=11, rank=3).double()
    sel.reset_parameters()
    h = torch.randn(5, 8, dtype=torch.float64)
    prev = torch.randint(0, 11, (5,))
    cand = torch.randint(0, 11, (5, 4))
    unary = torch.randn(5, 4, dtype=torch.float64)
    assert torch.equal(sel(h, prev, cand, unary), unary)
    with torch.no_grad():
        sel.successor_codebook.normal_()
    s = sel(h, prev, cand, unary)
    for m in range(5):
        ph = sel.hidden_projection.weight @ h[m]
        for j in range(4):
            ref = (
                unary[m, j]
                + (
                    sel.predecessor_codebook[prev[m]] * ph * sel.successor_codebook[cand[m, j]]
                ).sum()
            )
            assert math.isclose(s[m, j].item(), ref.item(), rel_tol=1e-12, abs_tol=1e-12)


def test_sample_anchors_rules():
    f = _features()
    a, keep = sample_anchors(
        f.loss_mask, f.valid_lengths, 50, False, torch.Generator().manual_seed(0)
    )
    lm, vl = f.loss_mask, f.valid_lengths
    cand = [
        [t for t in range(S - 1) if lm[i, t] and lm[i, t + 1] and t + 1 < vl[i]] for i in range(B)
    ]
    assert a.shape[1] == max(len(c) for c in cand)  # min(num_anchors, largest count)
    for i in range(B):
        kept = a[i][keep[i]].tolist()
        assert sorted(kept) == cand[i]  # all candidates taken, sorted, unique
        assert not keep[i, len(kept) :].any()  # padded slots last
    a2, keep2 = sample_anchors(
        f.loss_mask, f.valid_lengths, 3, False, torch.Generator().manual_seed(0)
    )
    a3, _ = sample_anchors(f.loss_mask, f.valid_lengths, 3, False, torch.Generator().manual_seed(0))
    assert a2.shape == (B, 3) and torch.equal(a2, a3)
    assert all(x in cand[i] for i in range(B) for x in a2[i][keep2[i]].tolist())
    assert (a2[keep2].view(-1) >= 0).all() and all(
        (a2[i][keep2[i]].diff() > 0).all() for i in range(B)
    )
    a4, keep4 = sample_anchors(f.loss_mask, f.valid_lengths, 40, True, None)
    assert a4.shape == (B, 40) and keep4.sum(1).tolist() == [len(c) for c in cand]


def test_set_train_progress_ramp():
    model = _model(
        replace(ARGS, selector_loss_weight=2.0, selector_warmup_ratio=0.1, selector_ramp_ratio=0.2),
        randomize=False,
    )
    alphas = []
    for step in (1, 10, 11, 20, 30, 31, 100):
        model.set_train_progress(step, 100)
        alphas.append(model.selector_alpha)
    assert alphas == [0.0, 0.0, 0.1, 1.0, 2.0, 2.0, 2.0]


def test_bf16_compute_dtype_and_frozen_tables_not_in_state_dict():
    model = _model(dtype=torch.bfloat16, randomize=False)
    f = _features(torch.float32)
    anchors, keep = sample_anchors(f.loss_mask, f.valid_lengths, 4, True, None)
    h, _ = model.block_hidden(f, anchors, keep)
    assert h.dtype == torch.bfloat16
    out = model.forward_with_anchors(f, anchors, keep)
    assert out.loss_sum.dtype == torch.float32 and torch.isfinite(out.loss_sum)
    assert {n for n, _ in model.named_buffers()} == {"target_embed", "target_lm_head"}
    assert not any("target_" in k for k in model.state_dict())
    with pytest.raises(RuntimeError, match="load_frozen_tables"):
        DFlash2Draft(ARGS).forward_with_anchors(f, anchors, keep)
