"""The sampled proposals (T > 0) are what a CUDA graph replays too: DSpark's chain, EAGLE-3's chain
and DFlash2's selector walk, each drawing its tokens with the uniforms put on the device before the
proposal, read no device value on the host and bake in no host value (the greedy proposals are
checked in test_proposals_graph_safe.py); and they do draw (not the greedy chain)."""

from __future__ import annotations

from dataclasses import replace

import torch

from models.dflash2.args import dflash2_flavors
from models.dflash2.model import DFlash2Draft
from models.dflash2.proposal import DFlashProposer
from models.dspark import DSparkProposer
from models.eagle3 import Eagle3Proposer
from tests.unit.decoding.test_proposals_graph_safe import (
    dspark_draft,
    eagle3_draft,
    no_host_reads,
    run_rounds,
)

T = 2.0


def _sampling(prop, seed: int) -> None:
    prop.set_sampling(T, torch.Generator().manual_seed(seed))
    prop.sampler.draw_uniforms()


def _dflash2_draft() -> DFlash2Draft:
    a = replace(dflash2_flavors["debugmodel"], vocab_size=97, target_layer_ids=[0, 1], num_target_layers=2,
                mask_token_id=96)
    torch.manual_seed(0)
    d = DFlash2Draft(a).double()
    d.init_weights()
    g = torch.Generator().manual_seed(1)
    d.load_frozen_tables(torch.randn(97, a.hidden_size, generator=g, dtype=torch.float64),
                         torch.randn(97, a.hidden_size, generator=g, dtype=torch.float64))
    return d.eval()


@torch.no_grad()
def test_sampled_proposals_read_nothing_on_the_host():
    d = dspark_draft("rnn")
    prop = DSparkProposer(d, confidence_threshold=0.1)
    run_rounds([prop], d.args.vocab_size, rounds=2)
    greedy = prop._propose()[0]
    drew = False
    for seed in range(4):
        _sampling(prop, seed)
        prop._anchor.fill_(3)
        with no_host_reads():
            tokens = prop._propose()[0]
        drew |= tokens.tolist() != greedy.tolist()
    assert drew

    e = eagle3_draft()
    eprop = Eagle3Proposer(e, num_draft_tokens=4)
    run_rounds([eprop], e.args.vocab_size, rounds=2)
    _sampling(eprop, 0)
    eprop._start_chain(3)
    with no_host_reads():
        picks = eprop._chain()[0]
    assert picks.shape == (4,)

    f = _dflash2_draft()
    for outside in (False, True):  # q on the candidates alone, or the unary's outside them too
        fprop = DFlashProposer(f, outside_candidates=outside)
        run_rounds([fprop], 97, rounds=2)
        _sampling(fprop, 0)
        fprop._anchor.fill_(3)
        with no_host_reads():
            tokens, probs = fprop._propose()
        assert tokens.shape == (f.args.block_size - 1,) and probs.shape == tokens.shape + (97,)
