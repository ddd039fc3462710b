"""The rejection rule with the draft's q exactly (``sampling.rejection_terms``, the terms
``verify_sampled`` draws with): a round's output, followed by plain sampling to a fixed length, has
the target's distribution for any p and q (q with zeros, q = p, point masses), enumerated in
float64 over a tiny vocabulary, with drafts chained (q and p of each position depend on the drafts
before it); a draft drawn from q is accepted with probability sum_v min(p, q)."""

from __future__ import annotations

import itertools

import pytest
import torch

from titan_draft.decoding.sampling import rejection_terms

V, N = 3, 2


def _table(seed: int, zeros: bool = False) -> dict:
    """A distribution over V tokens for every prefix of up to N tokens (float64)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n in range(N + 1):
        for prefix in itertools.product(range(V), repeat=n):
            row = torch.rand(V, generator=g, dtype=torch.float64) + 0.05
            if zeros:
                row[int(torch.randint(0, V, (1,), generator=g))] = 0.0
            out[prefix] = row / row.sum()
    return out


def _target_prob(p: dict, seq: tuple, start: int = 0) -> float:
    """P(seq[start:] | seq[:start]) under the prefix table ``p``."""
    out = 1.0
    for i in range(start, len(seq)):
        out *= float(p[seq[:i]][seq[i]])
    return out


def _speculative_prob(p: dict, q: dict | None, greedy: tuple | None, seq: tuple) -> float:
    """P(a round, then plain sampling to N + 1 tokens, outputs ``seq``): every draft chain d
    (q's probability, or the one greedy chain), every accept count m."""
    total = 0.0
    chains = [greedy] if q is None else itertools.product(range(V), repeat=N)
    for d in chains:
        w = 1.0 if q is None else _target_prob(q, d)
        if w == 0.0:
            continue
        probs = torch.stack([p[d[:i]] for i in range(N + 1)])
        qs = None if q is None else torch.stack([q[d[:i]] for i in range(N)])
        accept, residual = rejection_terms(torch.tensor(d), probs, qs)
        keep = 1.0
        for m in range(N + 1):
            if seq[:m] != d[:m]:
                break
            last = float(accept[m]) if m < N else 1.0
            out = float(residual[m, seq[m]])
            rest = _target_prob(p, seq, m + 1)  # plain sampling after the round
            total += w * keep * (1.0 - last if m < N else 1.0) * out * rest
            keep *= last
    return total


@pytest.mark.parametrize("case", ["random", "q_zeros", "q_equals_p", "point_mass"])
def test_a_round_is_lossless_in_distribution(case):
    p = _table(0, zeros=case == "q_zeros")
    q = {"random": _table(1), "q_zeros": _table(2, zeros=True), "q_equals_p": p, "point_mass": None}[case]
    greedy = (2, 0) if case == "point_mass" else None
    total = 0.0
    for seq in itertools.product(range(V), repeat=N + 1):
        got = _speculative_prob(p, q, greedy, seq)
        assert got == pytest.approx(_target_prob(p, seq), abs=1e-12), seq
        total += got
    assert total == pytest.approx(1.0, abs=1e-12)
    if case == "q_equals_p":  # the draft is the target: every draft is accepted
        for d in itertools.product(range(V), repeat=N):
            probs = torch.stack([p[d[:i]] for i in range(N + 1)])
            accept, _ = rejection_terms(torch.tensor(d), probs, torch.stack([p[d[:i]] for i in range(N)]))
            assert accept.tolist() == [1.0] * N


def test_expected_acceptance_is_sum_of_min():
    """E_{d ~ q}[min(1, p(d) / q(d))] = sum_v min(p, q) = 1 - TV(p, q), q with zeros included."""
    g = torch.Generator().manual_seed(4)
    for _ in range(5):
        p = torch.softmax(torch.randn(7, generator=g, dtype=torch.float64) * 2, 0)
        q = torch.softmax(torch.randn(7, generator=g, dtype=torch.float64) * 2, 0)
        q[3] = 0.0
        q = q / q.sum()
        expected = sum(float(q[v]) * float(rejection_terms(torch.tensor([v]), torch.stack([p, p]), q[None])[0][0])
                       for v in range(7) if q[v] > 0)
        assert expected == pytest.approx(float(torch.minimum(p, q).sum()), abs=1e-14)
        assert expected == pytest.approx(1 - 0.5 * float((p - q).abs().sum()), abs=1e-14)


def test_point_mass_terms_are_the_greedy_rule():
    probs = torch.softmax(torch.randn(3, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64), -1)
    draft = torch.tensor([1, 4])
    accept, residual = rejection_terms(draft, probs, None)
    assert accept.tolist() == [float(probs[0, 1]), float(probs[1, 4])]
    want = probs[0].clone()
    want[1] = 0
    torch.testing.assert_close(residual[0], want / want.sum(), rtol=0, atol=1e-15)
    torch.testing.assert_close(residual[2], probs[2], rtol=0, atol=0)

