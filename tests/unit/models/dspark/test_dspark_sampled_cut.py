"""DSpark's confidence cut stays lossless at T > 0: whether slot k is kept (the running product
c_0 * .. * c_k against the threshold) must not read slot k's own drawn token, only the tokens
before it, or the verify rule would see d_k conditioned on its own survival, no longer a draw
from q_k. Slot k's confidence reads the previous token (the anchor, then d_{k-1}): changing d_k
leaves c_0 .. c_k as they are and moves c_{k+1}."""

from __future__ import annotations

import pytest
import torch

from models.dspark import DSparkProposer
from tests.unit.decoding.test_proposals_graph_safe import dspark_draft


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("with_markov", [True, False])
@torch.no_grad()
def test_a_slots_confidence_never_reads_its_own_draw(kind, with_markov):
    d = dspark_draft(kind, seed=3, enable_confidence_head=True, confidence_head_with_markov=with_markov)
    a = d.args
    g = torch.Generator().manual_seed(5)
    prop = DSparkProposer(d)
    prop.reset(64)
    prop.commit(torch.randint(0, a.vocab_size, (9,), generator=g),
                torch.randn(9, d.fc.in_features, generator=g, dtype=torch.float64))
    base = torch.randint(0, a.vocab_size, (a.block_size,), generator=g).tolist()
    _, _, conf = prop.walk(4, forced=base)
    moved = False
    for k in range(a.block_size):
        other = list(base)
        other[k] = (base[k] + 1 + k) % a.vocab_size
        _, _, c = prop.walk(4, forced=other)
        assert torch.equal(c[: k + 1], conf[: k + 1]), k
        moved |= k + 1 < a.block_size and not torch.equal(c[k + 1], conf[k + 1])
    assert moved == with_markov  # the confidence reads the previous token only through the Markov state


@torch.no_grad()
def test_sampled_proposal_cuts_where_its_own_chain_says():
    """At T > 0 with a threshold: the kept drafts are the sampled chain's prefix before the first
    slot whose product (computed on that same sampled chain) falls below the threshold, and q
    covers exactly the kept drafts."""
    d = dspark_draft("rnn", seed=4, enable_confidence_head=True)
    a = d.args
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, a.vocab_size, (9,), generator=g)
    aux = torch.randn(9, d.fc.in_features, generator=g, dtype=torch.float64)
    cuts = set()
    for seed in range(12):
        full, cut = DSparkProposer(d), DSparkProposer(d, confidence_threshold=0.093)
        for p in (full, cut):
            p.reset(64)
            p.commit(prompt, aux)
            p.set_sampling(1.0, torch.Generator().manual_seed(seed))
        chain, kept = full.propose(4).tolist(), cut.propose(4).tolist()
        _, _, conf = full.walk(4, forced=chain)
        want = int((torch.cumprod(conf.double(), 0) >= 0.093).long().cumprod(0).sum())
        assert kept == chain[:want] and cut.draft_probs.shape[0] == want
        torch.testing.assert_close(cut.draft_probs, full.draft_probs[:want], rtol=0, atol=0)
        cuts.add(want)
    assert len(cuts) > 1  # the cut moves with the draws
