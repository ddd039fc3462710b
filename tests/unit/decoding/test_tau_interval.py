"""Bootstrap intervals of tau over prompts: they cover the true ratio as often as they claim,
pairing removes the prompts' shared difficulty, and reports of other prompts are refused."""

import math
import random

import pytest

from titan_draft.decoding.tau_interval import (
    PromptMismatch,
    across_seeds,
    format_interval,
    paired_contrast,
    paired_difference,
    tau_interval,
)


def _prompt(name, tokens, rounds):
    return {"name": name, "round_tokens": tokens, "rounds": rounds}


def _draw_prompt(rng, difficulty, skill):
    """One prompt of a draft whose per-round acceptance is ``skill * difficulty`` (geometric runs)."""
    rounds = rng.randint(60, 180)
    p = min(0.95, skill * difficulty)
    tokens = 0
    for _ in range(rounds):
        tokens += 1
        while rng.random() < p:
            tokens += 1
    return rounds, tokens


def test_every_prompt_alike_gives_a_point():
    prompts = [_prompt(f"p{i}", 300, 150) for i in range(20)]
    iv = tau_interval(prompts)
    assert iv["tau"] == iv["low"] == iv["high"] == 2.0


def test_the_interval_covers_the_population_ratio_at_its_level():
    # Prompts of varied difficulty; the population's tau is E[tokens] / E[rounds], computed
    # from a large sample in float64 (plain Python), independent of the bootstrap.
    rng = random.Random(0)
    population = [_draw_prompt(rng, rng.uniform(0.2, 1.0), 0.8) for _ in range(20000)]
    true_tau = sum(t for _, t in population) / sum(r for r, _ in population)
    trials, covered, width_ratios = 300, 0, []
    for trial in range(trials):
        sample = [population[rng.randrange(len(population))] for _ in range(40)]
        iv = tau_interval([_prompt(f"p{i}", t, r) for i, (r, t) in enumerate(sample)], resamples=1000, seed=trial)
        covered += iv["low"] <= true_tau <= iv["high"]
        assert iv["low"] <= iv["tau"] <= iv["high"]
        # the delta method's width for a ratio of sums: 2 * 1.96 * sqrt(sum (t - tau r)^2) / sum r
        tau = sum(t for _, t in sample) / sum(r for r, _ in sample)
        se = math.sqrt(sum((t - tau * r) ** 2 for r, t in sample)) / sum(r for r, _ in sample)
        width_ratios.append((iv["high"] - iv["low"]) / (2 * 1.959964 * se))
    # 95 % nominal: a percentile bootstrap on 40 prompts covers ~93-95 %; an interval too narrow
    # (rounds resampled instead of prompts) covers far less
    assert 0.89 <= covered / trials <= 0.985, covered / trials
    # as wide as the delta method says (an interval from half the prompts would be 1.41x)
    assert 0.85 <= sum(width_ratios) / trials <= 1.15, sum(width_ratios) / trials


def test_a_level_of_half_is_narrower_than_95():
    rng = random.Random(1)
    prompts = [_prompt(f"p{i}", t, r) for i, (r, t) in
               enumerate(_draw_prompt(rng, rng.uniform(0.2, 1.0), 0.8) for _ in range(40))]
    wide, narrow = tau_interval(prompts), tau_interval(prompts, level=0.5)
    assert wide["low"] < narrow["low"] < narrow["high"] < wide["high"]


def _two_drafts(rng, n, skill_a, skill_b):
    a, b = [], []
    for i in range(n):
        difficulty = rng.uniform(0.1, 1.0)  # shared: a hard prompt is hard for both drafts
        ra, ta = _draw_prompt(rng, difficulty, skill_a)
        rb, tb = _draw_prompt(rng, difficulty, skill_b)
        a.append(_prompt(f"p{i}", ta, ra))
        b.append(_prompt(f"p{i}", tb, rb))
    return a, b


def test_pairing_establishes_an_order_the_separate_intervals_cannot():
    rng = random.Random(2)
    a, b = _two_drafts(rng, 40, 0.86, 0.78)
    ia, ib = tau_interval(a), tau_interval(b)
    assert ia["low"] < ib["high"]  # the two intervals overlap: alone they order nothing
    d = paired_difference(a, b)
    assert d["difference"] == pytest.approx(ia["tau"] - ib["tau"], abs=1e-12)
    assert d["established"] and 0 < d["low"] < d["difference"] < d["high"]
    assert d["a_ahead"] > 0.975
    flipped = paired_difference(b, a)
    assert flipped["established"] and flipped["high"] < 0 and flipped["a_ahead"] < 0.025


def test_equal_drafts_are_rarely_called_apart():
    rng = random.Random(3)
    trials = 200
    called = sum(paired_difference(*_two_drafts(rng, 40, 0.8, 0.8), resamples=1000, seed=t)["established"]
                 for t in range(trials))
    assert called / trials <= 0.1, called / trials


def test_reports_of_other_prompts_are_refused_in_one_line():
    a = [_prompt("mtbench:81", 10, 5), _prompt("mtbench:82", 10, 5)]
    with pytest.raises(PromptMismatch, match="mtbench:83"):
        paired_difference(a, [_prompt("mtbench:81", 10, 5), _prompt("mtbench:83", 10, 5)])
    with pytest.raises(PromptMismatch, match="another order"):
        paired_difference(a, a[::-1])
    with pytest.raises(ValueError, match="no prompts"):
        tau_interval([])


def _four_drafts(rng, n, skills):
    """Four drafts on the same prompts: a hard prompt is hard for all of them."""
    out = [[] for _ in skills]
    for i in range(n):
        difficulty = rng.uniform(0.1, 1.0)
        for draft, skill in zip(out, skills):
            rounds, tokens = _draw_prompt(rng, difficulty, skill)
            draft.append(_prompt(f"p{i}", tokens, rounds))
    return out


def _plain_tau(prompts):
    return sum(p["round_tokens"] for p in prompts) / sum(p["rounds"] for p in prompts)


def test_a_difference_in_differences_is_paired_across_all_four_evals():
    # A's change gains (0.70 -> 0.82), B's gains nothing (0.74 -> 0.74): the contrast says so, while
    # A's gain and B's stand-still, each read from its own paired interval, still overlap nothing
    # that says "more"; an interval resampled per eval (not paired) would not establish it.
    rng = random.Random(5)
    a1, a0, b1, b0 = _four_drafts(rng, 40, (0.82, 0.70, 0.74, 0.74))
    c = paired_contrast([a1, a0, b1, b0], [1, -1, -1, 1])
    expected = (_plain_tau(a1) - _plain_tau(a0)) - (_plain_tau(b1) - _plain_tau(b0))
    assert c["difference"] == pytest.approx(expected, abs=1e-12)
    assert c["established"] and 0 < c["low"] < c["difference"] < c["high"] and c["a_ahead"] > 0.975
    # the unpaired half-width: each eval's own interval, half-widths added in quadrature; pairing
    # cancels the prompts' shared difficulty, so the contrast's interval is much narrower
    unpaired = math.sqrt(sum(((iv["high"] - iv["low"]) / 2) ** 2 for iv in map(tau_interval, (a1, a0, b1, b0))))
    assert (c["high"] - c["low"]) / 2 < 0.75 * unpaired
    # two evals with weights (1, -1) are exactly the paired difference, interval and all
    assert paired_contrast([a1, a0], [1, -1]) == paired_difference(a1, a0)


def test_equal_gains_are_rarely_called_apart():
    rng = random.Random(6)
    trials = 150
    called = sum(paired_contrast(_four_drafts(rng, 40, (0.85, 0.75, 0.85, 0.75)), [1, -1, -1, 1],
                                 resamples=1000, seed=t)["established"] for t in range(trials))
    assert called / trials <= 0.1, called / trials


def test_a_contrast_needs_one_weight_per_eval_and_the_same_prompts():
    a = [_prompt("mtbench:81", 10, 5), _prompt("mtbench:82", 10, 5)]
    with pytest.raises(ValueError, match="3 evals for 4 weights"):
        paired_contrast([a, a, a], [1, -1, -1, 1])
    with pytest.raises(PromptMismatch, match="the evals were not decoded on the same prompts.*mtbench:83"):
        paired_contrast([a, a, a, [_prompt("mtbench:81", 10, 5), _prompt("mtbench:83", 10, 5)]], [1, -1, -1, 1])


def test_an_order_across_seeds_holds_only_where_every_pairing_of_seeds_holds():
    # A's second training seed came out no better than B (0.70 against 0.70, 0.70), its first
    # clearly better (0.82): the mean of A's seeds is ahead on the prompts, but which draft is
    # better depends on the seed drawn, so the order is not called; with both A seeds ahead it is.
    a_good, a_same, b1, b2, a_good2 = _four_drafts(random.Random(8), 40, (0.82, 0.70, 0.70, 0.70, 0.82))
    split = across_seeds([a_good, a_same], [b1, b2])
    taus_a, taus_b = [_plain_tau(x) for x in (a_good, a_same)], [_plain_tau(x) for x in (b1, b2)]
    assert split["tau_a"] == pytest.approx(sum(taus_a) / 2, abs=1e-12)
    assert split["tau_b"] == pytest.approx(sum(taus_b) / 2, abs=1e-12)
    assert split["spread_a"] == pytest.approx(abs(taus_a[0] - taus_a[1]), abs=1e-12)
    assert split["mean"]["difference"] == pytest.approx(split["tau_a"] - split["tau_b"], abs=1e-12)
    assert split["mean"]["established"]  # the prompts alone would call it
    assert [p["established"] for p in split["pairings"]] == [True, True, False, False]
    assert split["pairings"][2] == paired_difference(a_same, b1)
    assert not split["established"] and split["established_pairings"] == 2
    both = across_seeds([a_good, a_good2], [b1, b2])
    assert both["established"] and both["established_pairings"] == 4
    behind = across_seeds([b1, b2], [a_good, a_good2])
    assert behind["established"] and behind["mean"]["high"] < 0
    with pytest.raises(ValueError, match="each draft needs at least one eval"):
        across_seeds([], [b1])


def test_format_names_the_level_and_the_bounds():
    text = format_interval({"tau": 1.5049, "low": 1.4661, "high": 1.544, "level": 0.95})
    assert text == "1.505 (95 % interval 1.466 to 1.544)"


def test_the_eval_report_carries_and_prints_the_interval():
    from titan_draft.decoding.acceptance import EvalReport, PromptReport
    from titan_draft.decoding.evaluator import report_scalars

    rng = random.Random(4)
    prompts = []
    for i in range(12):
        rounds, tokens = _draw_prompt(rng, rng.uniform(0.2, 1.0), 0.8)
        prompts.append(PromptReport(name=f"p{i}", prompt_tokens=5, new_tokens=tokens, rounds=rounds,
                                    round_tokens=tokens, tau=tokens / rounds, speculative_s=1.0, accepted=[]))
    report = EvalReport(prompts=prompts, num_draft_tokens=3, max_new_tokens=256)
    s = report.summary()
    expected = tau_interval([_prompt(p.name, p.round_tokens, p.rounds) for p in prompts])
    assert s["tau_interval"] == expected and expected["low"] < s["tau"] < expected["high"]
    assert f"tau {format_interval(expected)} over 12 prompts" in report.table()
    scalars = report_scalars(report)
    assert (scalars["eval/tau_low"], scalars["eval/tau_high"]) == (expected["low"], expected["high"])
    assert EvalReport(prompts=[], num_draft_tokens=3, max_new_tokens=8).summary()["tau_interval"] is None
