"""A block-diffusion draft's training forward: anchors sampled, the draft's loss for them, and
``anchor_fill``, the share of the ``num_anchors`` slots the sampler could fill (a short row has
fewer candidates than slots)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.dflash2 import DFlash2Draft, dflash2_flavors
from models.dspark import DSparkDraft, dspark_flavors
from titan_draft.protocols import TargetFeatures

V, H, S, N = 61, 32, 40, 8
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=48, num_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, mask_token_id=V - 1, target_layer_ids=[0, 2], num_target_layers=4,
              attn_backend="sdpa", static_anchors=True, num_anchors=N)


def _draft(name: str):
    if name == "dflash2":
        d = DFlash2Draft(replace(dflash2_flavors["debugmodel"], **COMMON, block_size=4, conv_kernel_size=2,
                                 conv_group_size=8, selector_rank=4, selector_top_k=3, selector_topk_group=0))
    else:
        d = DSparkDraft(replace(dspark_flavors["debugmodel"], **COMMON, block_size=4, markov_rank=8))
    d = d.double()
    d.init_weights()
    g = torch.Generator().manual_seed(2)
    d.load_frozen_tables(torch.randn(V, H, generator=g, dtype=torch.float64),
                         torch.randn(V, H, generator=g, dtype=torch.float64))
    return d


@pytest.mark.parametrize("name", ["dflash2", "dspark"])
def test_anchor_fill_counts_the_slots_the_sampler_filled(name):
    d = _draft(name)
    g = torch.Generator().manual_seed(0)
    loss = torch.zeros(2, S, dtype=torch.bool)
    loss[0, 10:16] = True  # 5 candidates (t and t + 1 both loss tokens): 5 of the 8 slots
    loss[1, 4:30] = True  # 25 candidates: all 8
    f = TargetFeatures(torch.randint(0, V - 1, (2, S), generator=g), loss, torch.tensor([S, S]),
                       torch.randn(2, S, 2 * H, generator=g, dtype=torch.float64),
                       last_hidden=torch.randn(2, S, H, generator=g, dtype=torch.float64))
    out = d(f, generator=torch.Generator().manual_seed(1))
    kept, slots = out.metrics["anchor_fill"]
    assert (float(kept), float(slots)) == (5 + 8, 2 * N)
    # the loss is the draft's for the anchors the same draw gives
    anchors, keep = d.sample_anchors(f, torch.Generator().manual_seed(1))
    assert int(keep.sum()) == 13
    again = d.forward_with_anchors(f, anchors, keep)
    torch.testing.assert_close(out.loss_sum, again.loss_sum, rtol=0, atol=0)
    assert "anchor_fill" not in again.metrics  # given anchors: nothing was sampled
