"""EAGLE-3 at T > 0: each chain step draws its token from softmax(z / T) over the draft
vocabulary, the next step reads the DRAWN token, and the proposal hands the verify rule those
distributions on the target vocabulary (zero outside the draft's)."""

from __future__ import annotations

import torch
from helpers import inverse_cdf

from models.eagle3 import Eagle3Proposer
from tests.unit.decoding.test_proposals_graph_safe import eagle3_draft


@torch.no_grad()
def test_eagle3_samples_its_chain_from_the_drawn_tokens():
    d = eagle3_draft(seed=4)
    a = d.args
    g = torch.Generator().manual_seed(0)
    width = d.fc.in_features
    prompt = torch.randint(0, a.vocab_size, (9,), generator=g)
    aux = torch.randn(9, width, generator=g, dtype=torch.float64)
    last, temp, n = 5, 1.3, 4
    ids = d.draft_ids()
    differs = False
    for seed in range(5):
        prop, ref = Eagle3Proposer(d, num_draft_tokens=n), Eagle3Proposer(d, num_draft_tokens=n)
        for p in (prop, ref):
            p.reset(32)
            p.commit(prompt, aux)
        prop.set_sampling(temp, torch.Generator().manual_seed(seed))
        got = prop.propose(last).tolist()
        # the same chain with the drawn tokens forced in: its logits give each step's q
        _, outs = ref.chain(last, forced=got[:-1])
        u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        for k in range(n):
            qd = torch.softmax(d.lm_head(d.norm(outs[k]))[0, -1] / temp, dim=-1)
            want = torch.zeros(a.vocab_size, dtype=torch.float64).index_copy(0, ids, qd)
            torch.testing.assert_close(prop.draft_probs[k], want, rtol=0, atol=1e-12)
            assert got[k] == int(ids[inverse_cdf(qd, float(u[k]))])
        greedy = Eagle3Proposer(d, num_draft_tokens=n)
        greedy.reset(32)
        greedy.commit(prompt, aux)
        differs |= got != greedy.propose(last).tolist()
        assert greedy.draft_probs is None
    assert differs
