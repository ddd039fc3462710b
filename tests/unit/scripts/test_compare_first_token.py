"""scripts/compare_first_token.py: first-token reports side by side, by the target's certainty."""

from __future__ import annotations

import json
import random

import pytest

from scripts.compare_first_token import main
from titan_draft.decoding.first_token import TOP1_EDGES

# a draft that gains where the target is unsure and loses where it is sure (per bucket of TOP1_EDGES)
GAIN = (0.10, 0.08, 0.03, -0.02, -0.05, -0.02, -0.03)


def _bucket(x):
    return next(k for k, (lo, hi) in enumerate(zip(TOP1_EDGES, TOP1_EDGES[1:])) if lo <= x < hi or x == hi == 1.0)


def _decodes(rng, prompts, lean):
    """Each prompt's positions, their certainty drawn to lean unsure (lean < 1) or sure (> 1)."""
    out = []
    for i in range(prompts):
        n = rng.randint(20, 40)
        top1 = [min(1.0, rng.random() ** (1 / lean)) for _ in range(n - 3)]
        top1 += rng.sample(TOP1_EDGES[1:], 3)  # on an edge: the bucket above it (1.0: the last)
        out.append({"name": f"mtbench:{81 + i}", "tokens": [rng.randrange(100) for _ in range(n + 1)],
                    "target_top1": top1, "target_entropy": [1.0] * n})
    return out


def _report(tmp_path, name, decodes, accept_fn, context="1"):
    rows = []
    for d in decodes:
        acc = [accept_fn(x) for x in d["target_top1"]]
        rows.append({**d, "accept": acc, "argmax_match": [a > 0.5 for a in acc]})
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"temperature": 1.0, "contexts": {}, "decodes": {context: rows}}))
    return str(path)


def _base(x):
    return 0.3 + 0.4 * x


def _run(tmp_path, argv):
    out = tmp_path / "t.md"
    main([*argv, "--out", str(out)])
    return json.loads(out.with_suffix(".json").read_text())


def test_each_bucket_and_the_reweighted_mix_match_hand_sums(tmp_path):
    rng = random.Random(0)
    sampled, greedy = _decodes(rng, 30, lean=0.7), _decodes(rng, 30, lean=4.0)
    ref = _report(tmp_path, "ref", sampled, _base)
    new = _report(tmp_path, "new", sampled, lambda x: _base(x) + GAIN[_bucket(x)])
    mix = _report(tmp_path, "mix", greedy, _base, context="0")
    table = _run(tmp_path, ["--reference", "ref", f"ref={ref}", f"new={new}", "--mix", f"greedy={mix}:0"])

    positions = [x for d in sampled for x in d["target_top1"]]
    for k, row in enumerate(table["rows"][:-1]):
        xs = [x for x in positions if _bucket(x) == k]
        assert row["bucket"] == [TOP1_EDGES[k], TOP1_EDGES[k + 1]] and row["positions"] == len(xs)
        if not xs:
            continue
        want = sum(_base(x) for x in xs) / len(xs)
        assert row["labels"]["ref"]["accept"] == pytest.approx(want)
        assert row["labels"]["new"]["accept"] == pytest.approx(want + GAIN[k])
        vs = row["labels"]["new"]["vs_reference"]
        assert vs["difference"] == pytest.approx(GAIN[k]) and vs["established"]  # a constant gain: no spread
    everything = table["rows"][-1]
    assert everything["bucket"] == "all" and everything["positions"] == len(positions)
    assert everything["labels"]["new"]["vs_reference"]["difference"] == pytest.approx(
        sum(GAIN[_bucket(x)] for x in positions) / len(positions))

    # weighted by the greedy decodes' certainty: each bucket's gain times its share of those positions
    shares = [0.0] * len(GAIN)
    for d in greedy:
        for x in d["target_top1"]:
            shares[_bucket(x)] += 1
    shares = [c / sum(shares) for c in shares]
    (m,) = table["mixes"]
    assert m["weights"] == pytest.approx(shares)
    assert m["labels"]["new"]["vs_reference"]["difference"] == pytest.approx(sum(w * g for w, g in zip(shares, GAIN)))
    # the sure-leaning mix turns a gain over the sampled positions into a loss
    sampled_gain = everything["labels"]["new"]["vs_reference"]["difference"]
    assert sampled_gain > 0 > m["labels"]["new"]["vs_reference"]["difference"]


def test_reports_read_at_other_positions_or_without_the_context_are_refused(tmp_path, capsys):
    rng = random.Random(1)
    a, b = _decodes(rng, 5, 1.0), _decodes(rng, 5, 1.0)
    ra, rb = _report(tmp_path, "a", a, _base), _report(tmp_path, "b", b, _base)
    with pytest.raises(SystemExit):
        main([f"a={ra}", f"b={rb}"])
    assert "not read at the same positions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([f"a={ra}", "--context", "0"])
    assert "no decodes at context 0" in capsys.readouterr().err
