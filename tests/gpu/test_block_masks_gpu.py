"""On CUDA: the analytic flex BlockMasks (models/block_diffusion/mask.py, models/eagle3/block_mask.py)
drive compiled flex forward and backward exactly as create_block_mask's masks do, for DFlash2
and EAGLE-3 at shapes that take the analytic path, and agree with dense sdpa. CPU flex has no
backward and ignores the tile tables, so this is where the q-side tables (backward) are used.
Skipped without CUDA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import models.block_diffusion.draft as block_draft
import models.eagle3.objective as objective
from models.common import build_attention_mask
from models.block_diffusion.layers import sample_anchors
from models.dflash2 import DFlash2Draft, dflash2_flavors
from models.eagle3 import Eagle3Draft, eagle3_flavors
from titan_draft.protocols.features import TargetFeatures

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

V, H, SEQ = 512, 64, 256
DEV = "cuda"


def _tables(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, H, generator=g) * 0.5, torch.randn(V, H, generator=g) * 0.5


def _dflash2():
    args = replace(dflash2_flavors["debugmodel"], vocab_size=V, hidden_size=H, intermediate_size=128,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, block_size=8, num_anchors=32,
                   mask_token_id=V - 1, target_layer_ids=[1, 3], num_target_layers=6, static_anchors=True,
                   ce_chunk_rows=128)
    torch.manual_seed(0)
    return DFlash2Draft(args)


def _eagle3():
    args = replace(eagle3_flavors["debugmodel"], vocab_size=V, draft_vocab_size=128, hidden_size=H,
                   intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, ttt_steps=3,
                   target_layer_ids=[1, 2, 4], num_target_layers=6)
    torch.manual_seed(0)
    d = Eagle3Draft(args)
    d.init_weights()
    with torch.no_grad():
        d.d2t.copy_(torch.tensor(sorted(torch.randperm(V)[:128].tolist())) - torch.arange(128))
        d.t2d.zero_()
        d.t2d[d.draft_ids()] = True
    return d


def _features(n_aux, last_hidden):
    dev = torch.device(DEV)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V - 1, (2, SEQ), generator=g)
    loss = torch.rand(2, SEQ, generator=g) > 0.2
    loss[1, 40:] = False  # few anchor candidates in row 1: padded anchor slots
    return TargetFeatures(ids.to(dev), loss.to(dev), torch.tensor([SEQ, 181], device=dev),
                          torch.randn(2, SEQ, n_aux * H, generator=g).to(dev),
                          last_hidden=(torch.randn(2, SEQ, H, generator=g) * 2).to(dev) if last_hidden else None)


def _run(make, n_aux, last_hidden, backend, dense_masks, monkeypatch, backward=True):
    """Loss and grads of one fp32 step on CUDA; ``dense_masks`` swaps the analytic builders for
    create_block_mask (through build_attention_mask), the reference."""
    if dense_masks:
        monkeypatch.setattr(block_draft, "block_diffusion_block_mask",
                            lambda anchors, keep, seq, b, mask_mod, **_: build_attention_mask(
                                mask_mod, anchors.shape[0], anchors.shape[1] * b, seq + anchors.shape[1] * b,
                                anchors.device, "flex"))
        monkeypatch.setattr(objective, "ttt_block_mask",
                            lambda seq, lengths, i, mask_mod, **_: build_attention_mask(
                                mask_mod, lengths.shape[0], seq, (i + 1) * seq, lengths.device, "flex"))
    else:
        monkeypatch.undo()
    d = make()
    d.args = replace(d.args, attn_backend=backend)
    d = d.to(DEV)
    if isinstance(d, DFlash2Draft):
        d.init_weights()
    d.load_frozen_tables(*(t.to(DEV) for t in _tables(1)))
    f = _features(n_aux, last_hidden)
    if isinstance(d, DFlash2Draft):
        anchors, keep = sample_anchors(f.loss_mask, f.valid_lengths, d.args.num_anchors, True,
                                       torch.Generator(device=DEV).manual_seed(5))
        assert not keep.all() and anchors.shape[1] * d.args.block_size % 128 == 0
        out = d.forward_with_anchors(f, anchors, keep)
    else:
        out = d(f)
    if backward:
        out.loss_sum.backward()
    return out.loss_sum.detach(), {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make, n_aux, last_hidden", [(_dflash2, 2, False), (_eagle3, 3, True)],
                         ids=["dflash2", "eagle3"])
def test_analytic_masks_train_as_create_block_mask_does(make, n_aux, last_hidden, monkeypatch):
    ref_loss, ref_grads = _run(make, n_aux, last_hidden, "flex", True, monkeypatch)
    loss, grads = _run(make, n_aux, last_hidden, "flex", False, monkeypatch)
    sdpa_loss, sdpa_grads = _run(make, n_aux, last_hidden, "sdpa", False, monkeypatch)
    # same tile tables, same kernels: the same numbers
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and grads
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    # and the dense-mask sdpa computation agrees within fp32 kernel differences
    torch.testing.assert_close(loss, sdpa_loss, rtol=2e-3, atol=1e-3)
    for n in grads:
        torch.testing.assert_close(grads[n], sdpa_grads[n], rtol=2e-2, atol=2e-3, msg=n)
