"""``python -m titan_draft.eval --greedy-cache FILE``: a second eval takes its plain greedy decodes
(tokens, margins, speed) from the file instead of decoding them, checks its draft against them, and
a file made with another setting is decoded anew, never trusted. Also ``--round-timing N`` (the
eval's other option for timing studies): its report, and the settings it refuses; and the progress
lines a long eval prints as it goes."""

from __future__ import annotations

import json

import pytest
from helpers import job_args, run_training

import titan_draft.decoding.acceptance as acceptance
from titan_draft.eval import main as eval_main

EVAL = ("--prompts", "mtbench", "--num-prompts", "2", "--max-new-tokens", "6")


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, chat_jsonl, random_target_dir):
    dump = tmp_path_factory.mktemp("eval_greedy_cache")
    run_training(job_args(dump, chat_jsonl, random_target_dir, "--training.steps", "1"))
    return str(dump / "export")


def _eval(target, export, out, cache, *extra) -> dict:
    eval_main(["--target", target, "--draft", export, *EVAL, "--greedy-cache", str(cache), "--out", str(out), *extra])
    with open(out) as f:
        return json.load(f)


def _no_plain_decoding(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("plain greedy decoded although the cache holds it")

    monkeypatch.setattr(acceptance, "greedy_decode", refuse)


def test_a_second_eval_reuses_the_plain_decodes(export_dir, random_target_dir, tmp_path, monkeypatch):
    cache = tmp_path / "greedy.json"
    first = _eval(random_target_dir, export_dir, tmp_path / "a.json", cache)
    assert first["greedy_from_cache"] == 0 and first["summary"]["lossless_prompts"] == 2
    with monkeypatch.context() as m:
        _no_plain_decoding(m)
        second = _eval(random_target_dir, export_dir, tmp_path / "b.json", cache)
    assert second["greedy_from_cache"] == 2
    for key in ("tau", "lossless_prompts", "greedy_tokens_per_s", "rounds", "new_tokens"):
        assert second["summary"][key] == first["summary"][key], key
    assert [p["greedy_s"] for p in second["prompts"]] == [p["greedy_s"] for p in first["prompts"]]

    # the check runs against the cached tokens: a wrong cached token is a divergence
    with open(cache) as f:
        data = json.load(f)
    gen = data["entries"][0]["generation"]
    gen["tokens"][1] = (gen["tokens"][1] + 1) % 1000
    cache.write_text(json.dumps(data))
    with monkeypatch.context() as m:
        _no_plain_decoding(m)
        third = _eval(random_target_dir, export_dir, tmp_path / "c.json", cache)
    assert third["summary"]["lossless_prompts"] == 1 and third["summary"]["divergences"][0]["index"] == 1


def test_a_cache_of_another_setting_is_decoded_again(export_dir, random_target_dir, tmp_path, caplog):
    cache = tmp_path / "greedy.json"
    _eval(random_target_dir, export_dir, tmp_path / "a.json", cache)
    data = json.loads(cache.read_text())
    data["setting"]["boot"] = "another boot"
    cache.write_text(json.dumps(data))
    with caplog.at_level("INFO"):
        again = _eval(random_target_dir, export_dir, tmp_path / "b.json", cache)
    assert again["greedy_from_cache"] == 0 and again["summary"]["lossless_prompts"] == 2
    assert any("was made with another boot: decoding plain greedy again" in r.getMessage() for r in caplog.records)
    assert json.loads(cache.read_text())["setting"]["boot"] != "another boot"  # rewritten for this machine


@pytest.mark.parametrize("case", ["sampling", "not a cache"])
def test_refused_in_one_line(export_dir, random_target_dir, tmp_path, capsys, case):
    cache = tmp_path / "greedy.json"
    extra: tuple[str, ...] = ()
    if case == "sampling":
        extra = ("--temperature", "1")
        want = "--greedy-cache keeps plain greedy decodes: it needs --temperature 0 and the lossless check"
    else:
        cache.write_text('{"schema": "something else"}')
        want = f"--greedy-cache {cache}: not a readable greedy cache"
    with pytest.raises(SystemExit) as exit_info:
        _eval(random_target_dir, export_dir, tmp_path / "a.json", cache, *extra)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"titan_draft.eval: error: {want}"), err


def test_round_timing_adds_the_phases_to_the_report(export_dir, random_target_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    eval_main(["--target", random_target_dir, "--draft", export_dir, *EVAL, "--round-timing", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    rounds = report["round_ms"]
    # the second prompt's rounds (the first is the warm-up), decoded again the same way
    assert rounds["rounds"] == report["prompts"][1]["rounds"] > 0
    assert all(rounds[k] > 0 for k in ("proposal", "verify", "commit", "round"))
    # every round holds its phases, so the median round is at least each phase's median
    assert rounds["round"] >= max(rounds["proposal"], rounds["verify"], rounds["commit"])
    assert "round (each phase synchronized, median of" in capsys.readouterr().out


@pytest.mark.parametrize("extra,want", [
    (("--round-timing", "1"), "--round-timing 1: needs 2 .. 2 (the prompts; the first is the warm-up)"),
    (("--round-timing", "2", "--temperature", "1"), "--round-timing times greedy rounds: it needs --temperature 0"),
])
def test_round_timing_refused_in_one_line(export_dir, random_target_dir, capsys, extra, want):
    with pytest.raises(SystemExit) as exit_info:
        eval_main(["--target", random_target_dir, "--draft", export_dir, *EVAL, *extra])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"titan_draft.eval: error: {want}"


def test_progress_lines_add_up_to_the_report(export_dir, random_target_dir, tmp_path, capsys):
    """One line per prompt here (2 prompts: every tenth is every one); the last one's tau, rounds and
    lossless count are the report's own."""
    eval_main(["--target", random_target_dir, "--draft", export_dir, *EVAL, "--out", str(tmp_path / "p.json")])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "prompts decoded" in ln]
    report = json.loads((tmp_path / "p.json").read_text())
    s, first = report["summary"], report["prompts"][0]
    assert len(lines) == 2 and lines[0].startswith("titan_draft.eval: 1/2 prompts decoded")
    assert f"tau so far {first['round_tokens'] / first['rounds']:.3f} over {first['rounds']} rounds" in lines[0]
    assert lines[1].startswith("titan_draft.eval: 2/2 prompts decoded")
    assert f"tau so far {s['tau']:.3f} over {s['rounds']} rounds, lossless {s['lossless_prompts']}/2" in lines[1]
