"""scripts/compare_evals.py: finished eval reports side by side, each paired with a reference."""

from __future__ import annotations

import json
import random

import pytest

from scripts.compare_evals import main


def _write(tmp_path, name, rounds_tokens, temperature=0.0, max_new_tokens=64, names=None):
    names = names or [f"mtbench:{81 + i}" for i in range(len(rounds_tokens))]
    prompts = [{"name": n, "rounds": r, "round_tokens": t} for n, (r, t) in zip(names, rounds_tokens)]
    summary = {"temperature": temperature, "max_new_tokens": max_new_tokens, "accept_rate": [0.25, 0.05],
               "lossless_prompts": len(prompts) if temperature == 0 else None, "num_prompts": len(prompts)}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"summary": summary, "prompts": prompts}))
    return str(path)


def _prompts(rng, skill, difficulty):
    return [(50, 50 + sum(rng.random() < skill * d for _ in range(50))) for d in difficulty]


def _tau(rounds_tokens):
    return sum(t for _, t in rounds_tokens) / sum(r for r, _ in rounds_tokens)


def _table(tmp_path, argv):
    out = tmp_path / "table.md"
    main([*argv, "--out", str(out)])
    return json.loads(out.with_suffix(".json").read_text()), out.read_text()


def test_each_label_is_paired_with_the_reference_at_its_own_temperature(tmp_path):
    rng = random.Random(0)
    difficulty = [rng.uniform(0.1, 1.0) for _ in range(40)]
    ref0, ref1 = _prompts(rng, 0.3, difficulty), _prompts(rng, 0.6, difficulty)
    good0, good1 = _prompts(rng, 0.6, difficulty), _prompts(rng, 0.6, difficulty)
    table, text = _table(tmp_path, [
        "--reference", "default",
        f"good={_write(tmp_path, 'g0', good0)}", f"good={_write(tmp_path, 'g1', good1, temperature=1.0)}",
        f"default={_write(tmp_path, 'd1', ref1, temperature=1.0)}", f"default={_write(tmp_path, 'd0', ref0)}",
        f"same={_write(tmp_path, 's0', ref0)}"])
    assert table["temperatures"] == ["0", "1"]
    rows = {r["label"]: r["evals"] for r in table["rows"]}
    assert list(rows) == ["good", "default", "same"]
    for label, t, pts in (("good", "0", good0), ("good", "1", good1), ("default", "0", ref0), ("default", "1", ref1)):
        iv = rows[label][t]["interval"]
        assert iv["tau"] == pytest.approx(_tau(pts), abs=1e-12) and iv["low"] < iv["tau"] < iv["high"]
    g0, g1 = rows["good"]["0"]["vs_reference"], rows["good"]["1"]["vs_reference"]
    assert g0["difference"] == pytest.approx(_tau(good0) - _tau(ref0), abs=1e-12)  # T=0 against T=0 only
    assert g1["difference"] == pytest.approx(_tau(good1) - _tau(ref1), abs=1e-12)
    assert g0["established"] and g0["low"] > 0 and not g1["established"]
    same = rows["same"]["0"]["vs_reference"]
    assert same["difference"] == 0 and same["low"] == 0 == same["high"] and not same["established"]
    assert "1" not in rows["same"] and "vs_reference" not in rows["default"]["0"]
    assert "| default | " in text and "reference" in text and ", established" in text
    assert "| same | " in text and text.count("\n") == 2 + 3


def test_reports_on_other_prompts_are_named_not_paired(tmp_path):
    pts = [(50, 60)] * 5
    table, text = _table(tmp_path, [
        f"a={_write(tmp_path, 'a', pts)}",
        f"b={_write(tmp_path, 'b', pts, names=[f'other:{i}' for i in range(5)])}"])
    assert "not decoded on the same prompts" in table["rows"][1]["evals"]["0"]["vs_reference"]["not_paired"]
    assert "not paired: " in text


def test_diff_in_diff_pairs_four_reports_at_each_shared_temperature(tmp_path):
    rng = random.Random(1)
    difficulty = [rng.uniform(0.1, 1.0) for _ in range(40)]
    skills = {"a1": 0.7, "a0": 0.4, "b1": 0.45, "b0": 0.4}  # A gains 0.3, B 0.05
    pts = {k: _prompts(rng, v, difficulty) for k, v in skills.items()}
    argv = [f"{k}={_write(tmp_path, k, v)}" for k, v in pts.items()]
    argv.append(f"a1={_write(tmp_path, 'a1_t1', pts['a1'], temperature=1.0)}")  # only a1 at T = 1
    table, text = _table(tmp_path, [*argv, "--diff-in-diff", "a1,a0,b1,b0", "--diff-in-diff", "b1, b0, b1, b0"])
    gain, none = table["diff_in_diff"]  # T = 1 is skipped: the other three were not decoded there
    assert gain["temperature"] == "0" and gain["labels"] == ["a1", "a0", "b1", "b0"]
    expected = (_tau(pts["a1"]) - _tau(pts["a0"])) - (_tau(pts["b1"]) - _tau(pts["b0"]))
    assert gain["difference"] == pytest.approx(expected, abs=1e-12) and gain["established"] and gain["low"] > 0
    assert none["difference"] == 0 and none["low"] == 0 == none["high"] and not none["established"]
    assert "| 0 | (a1 − a0) − (b1 − b0) | +" in text and ", established |" in text
    assert "| 0 | (b1 − b0) − (b1 − b0) | +0.000 (+0.000 to +0.000) |" in text


def test_across_seeds_reports_each_drafts_seeds_and_calls_the_order_only_in_every_pairing(tmp_path):
    rng = random.Random(2)
    difficulty = [rng.uniform(0.1, 1.0) for _ in range(40)]
    skills = {"a1": 0.7, "a2": 0.7, "b1": 0.4, "b2": 0.4, "c1": 0.7, "c2": 0.4}
    pts = {k: _prompts(rng, v, difficulty) for k, v in skills.items()}
    argv = [f"{k}={_write(tmp_path, k, v)}" for k, v in pts.items()]
    argv.append(f"a1={_write(tmp_path, 'a1_t1', pts['a1'], temperature=1.0)}")  # only a1 at T = 1
    table, text = _table(tmp_path, [*argv, "--across-seeds", "a1+a2,b1+b2", "--across-seeds", "c1+c2, b1+b2"])
    ab, cb = table["across_seeds"]  # T = 1 is skipped: the others were not decoded there
    assert ab["temperature"] == "0" and ab["a"] == ["a1", "a2"] and ab["b"] == ["b1", "b2"]
    assert ab["tau_a"] == pytest.approx((_tau(pts["a1"]) + _tau(pts["a2"])) / 2, abs=1e-12)
    assert ab["spread_b"] == pytest.approx(abs(_tau(pts["b1"]) - _tau(pts["b2"])), abs=1e-12)
    assert ab["established"] and ab["established_pairings"] == 4
    # C's second seed is no better than B: its mean is ahead, the order is not called
    assert cb["mean"]["established"] and not cb["established"] and cb["established_pairings"] == 2
    assert "| 0 | a1 + a2 | b1 + b2 | " in text and "| 4 of 4, order established |" in text
    assert "| 0 | c1 + c2 | b1 + b2 | " in text and "| 2 of 4 |" in text


@pytest.mark.parametrize("option, spec, message", [
    ("--diff-in-diff", "a,b,a", "expected four labels A1,A0,B1,B0"),
    ("--diff-in-diff", "a,b,a,z", "z not among the labels (a, b, c)"),
    ("--diff-in-diff", "a,b,c,b", "no temperature at which all four were decoded"),
    ("--across-seeds", "a+b", "expected two drafts' seed labels, A1+A2,B1+B2"),
    ("--across-seeds", "a+,b", "expected two drafts' seed labels"),
    ("--across-seeds", "a+z,b", "z not among the labels (a, b, c)"),
    ("--across-seeds", "a+b,b", "a label appears twice"),
    ("--across-seeds", "a,c", "no temperature at which all of them were decoded"),
])
def test_a_bad_comparison_of_labels_gets_one_line(tmp_path, capsys, option, spec, message):
    pts = [(50, 60)] * 3
    with pytest.raises(SystemExit) as e:
        main([f"a={_write(tmp_path, 'a', pts)}", f"b={_write(tmp_path, 'b', pts)}",
              f"c={_write(tmp_path, 'c', pts, temperature=1.0)}", option, spec])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"compare_evals: error: {option}") and message in err and "\n" not in err


@pytest.mark.parametrize("case, message", [
    ("no_equals", "expected LABEL=PATH"),
    ("twice", "a: two reports at T = 0"),
    ("lengths", "at T = 0 the reports decoded different lengths (max_new_tokens a 64, b 256)"),
    ("reference", "--reference 'z' is not one of the labels (a, b)"),
    ("not_json", "cannot read an eval report"),
    ("no_rounds", "not an eval report with per-prompt rounds"),
    ("old", "the report's summary lacks temperature"),
])
def test_bad_reports_get_one_line(tmp_path, capsys, case, message):
    pts = [(50, 60)] * 3
    a = _write(tmp_path, "a", pts)
    b = _write(tmp_path, "b", pts, max_new_tokens=256 if case == "lengths" else 64)
    bad = tmp_path / "bad.json"
    if case == "not_json":
        bad.write_text("{cut off")
    elif case == "no_rounds":
        bad.write_text(json.dumps({"summary": {}, "prompts": [{"name": "x"}]}))
    elif case == "old":
        report = json.loads(open(a).read())
        del report["summary"]["temperature"]
        bad.write_text(json.dumps(report))
    argv = {"no_equals": ["a", a], "twice": [f"a={a}", f"a={b}"], "lengths": [f"a={a}", f"b={b}"],
            "reference": ["--reference", "z", f"a={a}", f"b={b}"]}.get(case, [f"a={a}", f"b={bad}"])
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("compare_evals: error: ") and message in err and "\n" not in err


def test_by_category_splits_the_prompts_by_mtbench_category_and_pairs_within_each(tmp_path):
    from titan_draft.data.chat.prompts import mtbench_categories
    categories = mtbench_categories()
    assert len(categories) == 80 and sorted(set(categories.values())) == [
        "coding", "extraction", "humanities", "math", "reasoning", "roleplay", "stem", "writing"]
    rng = random.Random(3)
    names = [*categories, "holdout:0", "holdout:1", "holdout:2"]
    difficulty = [rng.uniform(0.1, 1.0) for _ in names]
    ref = _prompts(rng, 0.4, difficulty)
    # b is ahead on math and coding only, behind everywhere else
    skill = [0.8 if categories.get(n) in ("math", "coding") else 0.2 for n in names]
    b = [(50, 50 + sum(rng.random() < s * d for _ in range(50))) for s, d in zip(skill, difficulty)]
    table, text = _table(tmp_path, ["--by-category", "--reference", "ref",
                                    f"ref={_write(tmp_path, 'r', ref, names=names)}",
                                    f"b={_write(tmp_path, 'b', b, names=names)}"])
    entries = {e["category"]: e["labels"] for e in table["by_category"]}
    assert sorted(entries) == sorted({*categories.values(), "holdout"})
    for kind, cells in entries.items():
        idx = [i for i, n in enumerate(names) if categories.get(n, "holdout") == kind]
        assert cells["ref"]["prompts"] == len(idx) == (3 if kind == "holdout" else 10)
        want_b, want_ref = _tau([b[i] for i in idx]), _tau([ref[i] for i in idx])
        assert cells["b"]["tau"] == pytest.approx(want_b, abs=1e-12)
        assert cells["ref"]["tau"] == pytest.approx(want_ref, abs=1e-12)
        d = cells["b"]["vs_reference"]
        assert d["difference"] == pytest.approx(want_b - want_ref, abs=1e-12) and "vs_reference" not in cells["ref"]
        if kind in ("math", "coding"):
            assert d["established"] and d["low"] > 0
        elif kind != "holdout":
            assert d["high"] < 0
    assert "| 0 | 10 | math | " in text and "| 0 | 3 | holdout | " in text and "b − ref (paired)" in text
    # the whole-prompt-set table is unchanged by the split, and absent without the flag
    plain, plain_text = _table(tmp_path, [f"ref={_write(tmp_path, 'r', ref, names=names)}",
                                          f"b={_write(tmp_path, 'b', b, names=names)}"])
    assert plain["by_category"] == [] and "category" not in plain_text
