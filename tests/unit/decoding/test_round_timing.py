"""``round_breakdown`` (``python -m titan_draft.eval --round-timing N``): each phase of a round is
timed where it runs, the prefill and the prompt's commit are no round's, and every round of the
timed prompts is counted once. The clock is the test's: the stand-ins below advance it by known
amounts, and the loop's own work advances it by nothing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import titan_draft.decoding.round_timing as round_timing
from models.targets.qwen3 import Qwen3Model, qwen3_flavors
from titan_draft.data.chat.prompts import EvalPrompt
from titan_draft.decoding.round_timing import breakdown_line, round_breakdown
from titan_draft.decoding.speculative import greedy_decode, speculative_decode
from tests.unit.decoding.test_speculative import ScriptedProposer

CPU = torch.device("cpu")
VOCAB = 257
PROPOSE, VERIFY, COMMIT, PREFILL = 30.0, 15.0, 5.0, 200.0  # seconds on the test's clock


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(round_timing, "_now", c)
    return c


@pytest.fixture(scope="module")
def target() -> Qwen3Model:
    m = Qwen3Model(replace(qwen3_flavors["debugmodel"], vocab_size=VOCAB)).double().eval()
    m.init_weights(seed=5)
    return m


class SlowTarget:
    """The target; each forward advances the clock: the first of a sequence (the prefill) by
    PREFILL, the others (verify passes) by VERIFY."""

    def __init__(self, target, clock: Clock):
        self.target, self.clock, self.first = target, clock, True

    def new_cache(self, *args, **kwargs):
        self.first = True
        return self.target.new_cache(*args, **kwargs)

    def __call__(self, *args, **kwargs):
        self.clock.t += PREFILL if self.first else VERIFY
        self.first = False
        return self.target(*args, **kwargs)


class SlowProposers:
    """A scripted proposer for each prompt in turn (the greedy continuation, 2 of 4 drafts right);
    a proposal advances the clock by PROPOSE, a commit by COMMIT, the prompt's commit by PREFILL."""

    num_draft_tokens, capture_layers, needs_last_hidden, draft_probs = 4, [1], False, None

    def __init__(self, pairs, clock: Clock):
        self.pairs, self.clock, self.i, self.p = pairs, clock, -1, None

    def set_sampling(self, temperature, generator=None):
        pass

    def reset(self, max_len):
        self.i += 1
        self.p = ScriptedProposer(*self.pairs[self.i], 4, 2)

    def commit(self, token_ids, aux, last_hidden):
        self.clock.t += COMMIT if self.p.committed else PREFILL
        self.p.commit(token_ids, aux, last_hidden)

    def propose(self, last_token):
        self.clock.t += PROPOSE
        return self.p.propose(last_token)


def _pairs(target, n: int):
    out = []
    for i in range(n):
        ids = torch.randint(0, VOCAB - 1, (7 + i,), generator=torch.Generator().manual_seed(i)).tolist()
        out.append((ids, greedy_decode(target, ids, 40, [], CPU).tokens))
    return out


def test_each_phase_is_timed_where_it_runs(target, clock):
    pairs = _pairs(target, 1)
    ids, truth = pairs[0]
    tick = round_timing._Clock(CPU)
    spec = speculative_decode(round_timing._TimedTarget(SlowTarget(target, clock), tick),
                              round_timing._TimedProposer(SlowProposers(pairs, clock), tick), ids, 16, [], CPU)
    tick.end_round()
    assert spec.tokens == truth[:16] and spec.accepted == [2] * spec.rounds and spec.rounds > 3
    # one entry a proposal, each with one proposal, one verify pass and one commit; never the
    # prefill or the prompt's commit; nothing else advanced the clock
    assert tick.rounds == [{"proposal": PROPOSE, "verify": VERIFY, "commit": COMMIT,
                            "round": PROPOSE + VERIFY + COMMIT}] * spec.rounds


def test_breakdown_counts_the_rounds_after_the_warm_up(target, clock):
    pairs = _pairs(target, 3)
    prompts = [EvalPrompt(f"p{i}", ids) for i, (ids, _) in enumerate(pairs)]
    b = round_breakdown(SlowTarget(target, clock), SlowProposers(pairs, clock), prompts, max_new_tokens=12,
                        stop_ids=[], device=CPU)
    want = sum(speculative_decode(target, ScriptedProposer(ids, t, 4, 2), ids, 12, [], CPU).rounds for ids, t in pairs[1:])
    assert b == {"rounds": want, "proposal": 1e3 * PROPOSE, "verify": 1e3 * VERIFY, "commit": 1e3 * COMMIT,
                 "loop": 0.0, "round": 1e3 * (PROPOSE + VERIFY + COMMIT)}
    assert breakdown_line(b).startswith(f"round (each phase synchronized, median of {want} rounds): proposal 30000.00 ms")
    with pytest.raises(ValueError, match="leave none after the 1 warm-up"):
        round_breakdown(target, SlowProposers(pairs, clock), prompts[:1], max_new_tokens=12, stop_ids=[], device=CPU)
