"""Speculative sampling at T > 0 draws sequences with exactly plain sampling's probabilities:
checked against the exact distribution of a Markov-chain target, for a draft that is often right,
one that is always wrong and one that drafts nothing; and the rejection rule's own outcome
distribution against its closed form."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from titan_draft.decoding.sampling import (
    sample_decode,
    speculative_sample,
    tempered_probs,
    verify_sampled,
)
from helpers import GreedyDrafter

V, T = 4, 0.8
TABLE = torch.tensor([[2.0, 1.0, 0.0, -1.0],
                      [0.0, 2.5, 0.5, 0.0],
                      [1.0, 0.0, 1.0, 1.5],
                      [0.5, 0.5, 2.0, 0.0]], dtype=torch.float64)  # next-token logits by last token


class _Cache:
    def __init__(self):
        self.length = 0

    def crop(self, length: int) -> None:
        assert 0 <= length <= self.length
        self.length = length


class MarkovTarget:
    """A target whose next-token logits depend on the last token only; its cache counts slots."""

    def new_cache(self, batch, max_len):
        return _Cache()

    def __call__(self, ids, layers=(), need_last=False, *, cache, logits="last", need_last_hidden=False):
        cache.length += ids.shape[1]
        out = TABLE[ids]
        if logits == "last":
            out = out[:, -1:]
        return SimpleNamespace(logits=out, aux=torch.zeros(1, ids.shape[1], 1), last_hidden=None)


class ChainProposer(GreedyDrafter):
    """Drafts ``k`` tokens, each ``(prev + shift) % V`` (shift 0 follows the target's mode of
    rows 0 and 1; 3 is never the mode)."""

    capture_layers: list[int] = []
    needs_last_hidden = False

    def __init__(self, k: int, shift: int):
        self.num_draft_tokens, self.shift = k, shift
        self.committed = 0

    def reset(self, max_len):
        self.committed = 0

    def commit(self, token_ids, aux, last_hidden):
        self.committed += token_ids.numel()

    def propose(self, last_token):
        out, t = [], last_token
        for _ in range(self.num_draft_tokens):
            t = (t + self.shift) % V
            out.append(t)
        return torch.tensor(out, dtype=torch.long)


def _exact(prompt_last: int, n: int) -> dict[tuple[int, ...], float]:
    p = tempered_probs(TABLE, T)
    dist = {}
    for seq in itertools.product(range(V), repeat=n):
        prob, prev = 1.0, prompt_last
        for t in seq:
            prob *= float(p[prev, t])
            prev = t
        dist[seq] = prob
    return dist


def _tv(counts: dict, exact: dict, runs: int) -> float:
    return 0.5 * sum(abs(counts.get(k, 0) / runs - v) for k, v in exact.items())


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny decodes: with several intra-op threads each softmax pays a parallel
    region's wake-up, ~40x the work itself on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


RUNS, NEW = 8000, 3
# E[TV] of RUNS draws from these 64 outcomes is ~0.021 (0.5 * sum sqrt(2 p / (pi RUNS))), its
# standard deviation ~0.004; a rule that trusts the draft (always accepts) is off by > 0.25.
BOUND = 0.045


@pytest.mark.parametrize("k,shift", [(3, 0), (2, 3), (0, 1)])
def test_speculative_sampling_matches_the_target_distribution(k, shift):
    target, prompt = MarkovTarget(), [2, 1]
    exact = _exact(prompt[-1], NEW)
    g = torch.Generator().manual_seed(1234 + k)
    counts: dict = {}
    accepted = 0
    for _ in range(RUNS):
        out = speculative_sample(target, ChainProposer(k, shift), prompt, NEW, [], torch.device("cpu"),
                                 temperature=T, generator=g)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        assert len(out.tokens) == NEW and sum(out.accepted) <= sum(out.proposed)
        accepted += sum(out.accepted)
    assert _tv(counts, exact, RUNS) < BOUND
    if shift == 0:
        assert accepted > RUNS  # the draft is right often enough that rounds carry several tokens


def test_plain_sampling_matches_the_target_distribution():
    target, prompt = MarkovTarget(), [0]
    exact = _exact(prompt[-1], NEW)
    g = torch.Generator().manual_seed(7)
    counts: dict = {}
    for _ in range(RUNS):
        out = sample_decode(target, prompt, NEW, [], torch.device("cpu"), temperature=T, generator=g)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    assert _tv(counts, exact, RUNS) < BOUND


def test_rejection_rule_outcomes_equal_their_closed_form():
    """P(m = i, token = t) = prod_{j<i} p_j(d_j) * p_i(t) for t != d_i (i < n); P(m = n, t) =
    prod_j p_j(d_j) * p_n(t); the draft token is never the residual draw."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(3, V, generator=g, dtype=torch.float64), dim=-1)
    draft = torch.tensor([1, 3])
    exact = {}
    keep = 1.0
    for i in range(3):
        for t in range(V):
            if i < 2 and t == int(draft[i]):
                continue
            exact[(i, t)] = keep * float(probs[i, t])
        if i < 2:
            keep *= float(probs[i, draft[i]])
    assert sum(exact.values()) == pytest.approx(1.0)
    runs, counts = 20000, {}
    for _ in range(runs):
        out = verify_sampled(draft, probs, g)
        counts[out] = counts.get(out, 0) + 1
    assert set(counts) <= set(exact)
    assert _tv(counts, exact, runs) < 0.03


def test_temperature_must_be_positive():
    with pytest.raises(ValueError, match="temperature"):
        tempered_probs(torch.zeros(3), 0.0)


def test_eval_at_temperature_reports_sampling_reproducibly():
    """``evaluate(temperature=T)``: speculative sampling per prompt from its own seed, tau from
    its rounds, no token-for-token lossless claim; the same seed gives the same report."""
    from titan_draft.decoding.acceptance import evaluate
    from titan_draft.data.chat.prompts import EvalPrompt

    prompts = [EvalPrompt(name=f"p{i}", ids=[i % V, (i + 1) % V]) for i in range(3)]

    def run(seed):
        return evaluate(MarkovTarget(), ChainProposer(3, 0), prompts, max_new_tokens=12, stop_ids=[],
                        device=torch.device("cpu"), temperature=T, seed=seed)

    a, b, c = run(5), run(5), run(6)
    assert [p.accepted for p in a.prompts] == [p.accepted for p in b.prompts]
    assert [p.accepted for p in a.prompts] != [p.accepted for p in c.prompts]
    s = a.summary()
    assert s["temperature"] == T and s["lossless_prompts"] is None and s["tau"] > 1.0
    assert "sampling at T=0.8" in a.table() and "in distribution" in a.table()
    greedy = evaluate(MarkovTarget(), ChainProposer(3, 0), prompts, max_new_tokens=12, stop_ids=[],
                      device=torch.device("cpu"))
    assert greedy.summary()["lossless_prompts"] == 3 and greedy.summary()["temperature"] == 0.0


Q_TABLE = torch.tensor([[0.0, 1.0, 2.0, 0.5],
                        [1.5, 0.0, 0.0, 1.0],
                        [0.0, 2.0, 0.0, -9.0],
                        [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)  # the draft's own Markov chain


class SampledChainProposer(GreedyDrafter):
    """Drafts ``k`` tokens by sampling its own Markov chain ``softmax(Q_TABLE[prev] / T)`` (far
    from the target's), each draw conditioning the next, and hands over those distributions."""

    capture_layers: list[int] = []
    needs_last_hidden = False

    def __init__(self, k: int):
        self.num_draft_tokens, self.generator = k, None

    def set_sampling(self, temperature, generator=None):
        assert temperature == T
        self.generator = generator

    def reset(self, max_len):
        pass

    def commit(self, token_ids, aux, last_hidden):
        pass

    def propose(self, last_token):
        out, rows, t = [], [], last_token
        for _ in range(self.num_draft_tokens):
            q = tempered_probs(Q_TABLE[t], T)
            t = int(torch.multinomial(q, 1, generator=self.generator))
            out.append(t)
            rows.append(q)
        self.draft_probs = torch.stack(rows) if rows else None
        return torch.tensor(out, dtype=torch.long)


def test_speculative_sampling_with_draft_distributions_matches_the_target():
    """Drafts drawn from the draft's own q and verified with min(1, p/q) and the residual
    max(p - q, 0): the output is still distributed as the target's."""
    target, prompt = MarkovTarget(), [2, 1]
    exact = _exact(prompt[-1], NEW)
    g = torch.Generator().manual_seed(99)
    counts: dict = {}
    for _ in range(RUNS):
        out = speculative_sample(target, SampledChainProposer(2), prompt, NEW, [], torch.device("cpu"),
                                 temperature=T, generator=g)
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
        assert out.sampled_rounds == out.rounds
    assert _tv(counts, exact, RUNS) < BOUND


def _closed_form_with_q(draft, probs, q) -> dict:
    """P(m = i, token = t): the drafts before i accepted (each with min(1, p/q)), draft i rejected
    and t drawn from the residual max(p_i - q_i, 0); or all accepted and t from p_n."""
    exact, keep = {}, 1.0
    n = draft.numel()
    for i in range(n + 1):
        if i == n:
            for t in range(V):
                exact[(i, t)] = keep * float(probs[n, t])
            break
        d = int(draft[i])
        acc = min(1.0, float(probs[i, d] / q[i, d]))
        res = (probs[i] - q[i]).clamp(min=0)
        for t in range(V):
            if res[t] > 0:
                exact[(i, t)] = keep * (1 - acc) * float(res[t] / res.sum())
        keep *= acc
    return exact


def test_rejection_rule_with_q_equals_its_closed_form():
    """The rule's outcomes with draft distributions q (one of them zero on a token) equal the
    closed form; the point-mass rule on the same drafts gives another distribution, so the
    draft distributions are really used."""
    g = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(3, V, generator=g, dtype=torch.float64), dim=-1)
    q = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    draft = torch.tensor([1, 3])
    exact = _closed_form_with_q(draft, probs, q)
    assert sum(exact.values()) == pytest.approx(1.0)
    point_mass = _closed_form_with_q(draft, probs, torch.nn.functional.one_hot(draft, V).double())
    assert 0.5 * sum(abs(exact.get(k, 0) - point_mass.get(k, 0)) for k in set(exact) | set(point_mass)) > 0.1
    runs, counts = 20000, {}
    for _ in range(runs):
        out = verify_sampled(draft, probs, g, q)
        counts[out] = counts.get(out, 0) + 1
    assert set(counts) <= set(exact)
    assert _tv(counts, exact, runs) < 0.03


def test_acceptance_of_a_sampled_draft_is_one_minus_total_variation():
    """With d ~ q, P(accept d) = sum_v min(p, q)(v) (fp64, by enumeration of d)."""
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), dim=-1)
    q = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), dim=-1)
    probs = torch.stack([p, p])
    accept = 0.0
    for d in range(V):
        exact = _closed_form_with_q(torch.tensor([d]), probs, q[None])
        accept += float(q[d]) * sum(v for (i, _), v in exact.items() if i == 1)
    assert accept == pytest.approx(float(torch.minimum(p, q).sum()), abs=1e-12)


def test_inverse_cdf_pick_never_picks_a_zero_probability_token():
    from models.common.sampling import inverse_cdf_pick

    q = torch.tensor([[0.0, 0.5, 0.0, 0.5]] * 3, dtype=torch.float64)
    assert inverse_cdf_pick(q, torch.tensor([0.0, 0.5, 0.999999])).tolist() == [1, 3, 3]
    grid = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    picks = inverse_cdf_pick(torch.tensor([[0.1, 0.0, 0.7, 0.2]], dtype=torch.float64).expand(1000, 4), grid)
    assert torch.bincount(picks, minlength=4).tolist() == [100, 0, 700, 200]


def test_eval_report_says_how_drafts_were_sampled():
    from titan_draft.decoding.acceptance import evaluate
    from titan_draft.data.chat.prompts import EvalPrompt

    prompts = [EvalPrompt(name="p", ids=[1, 2])]
    kw = dict(max_new_tokens=8, stop_ids=[], device=torch.device("cpu"), temperature=T, seed=1)
    sampled = evaluate(MarkovTarget(), SampledChainProposer(2), prompts, **kw)
    assert sampled.summary()["draft_sampling"] == "q" and "drafts drawn from q" in sampled.table()
    point = evaluate(MarkovTarget(), ChainProposer(2, 0), prompts, **kw)
    assert point.summary()["draft_sampling"] == "point mass" and "drafts as point mass" in point.table()
    kw["temperature"] = 0.0
    assert evaluate(MarkovTarget(), ChainProposer(2, 0), prompts, **kw).summary()["draft_sampling"] == "greedy"
