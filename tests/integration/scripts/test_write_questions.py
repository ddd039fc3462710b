"""scripts/write_questions.py: the target's own questions, sampled from its chat format up to a user
turn, kept or dropped (and counted) by what they are, resumable to the same file, and answered by
regenerate_data.py as any other prompt source."""

from __future__ import annotations

import json
import os

import pytest
import torch

import scripts.write_questions as wq
from scripts.regenerate_data import main as regenerate
from titan_draft.data.chat.format import resolve_chat_format
from titan_draft.data.chat.prompts import mtbench_questions, render_prompt, stop_token_ids
from titan_draft.data.chat.template import Turn, user_turn_prefix
from titan_draft.data.sources.rows import load_rows
from titan_draft.data.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok(random_target_dir):
    return build_tokenizer(random_target_dir)


@pytest.mark.parametrize("system_prompt", ["auto", "", "Answer briefly."])
def test_the_prefix_is_where_a_rendered_question_starts(tok, system_prompt):
    chat = resolve_chat_format(tok, template="auto", system_prompt=system_prompt)
    prefix = user_turn_prefix(tok, chat.template, chat.system_prompt)
    question = "Why is the sky blue?"
    full = render_prompt([Turn("user", question)], tok, chat.template, chat.system_prompt)
    text = tok.decode(full)
    assert tok.decode(prefix) + question == text[: len(tok.decode(prefix)) + len(question)]
    assert full[: len(prefix)] == prefix
    assert "assistant" not in tok.decode(prefix)  # the user turn's header, nothing of an answer
    if chat.system_prompt:
        assert tok.decode(prefix).startswith(f"<|im_start|>system\n{chat.system_prompt}<|im_end|>")
    else:
        assert tok.decode(prefix) == "<|im_start|>user\n"


def test_keep_question_drops_and_names_each_kind(tok):
    stops = set(stop_token_ids(tok, "qwen3"))
    stop = min(stops)
    specials = {tok.token_id(s) for s in tok.encoding.special_tokens_set} - stops
    q81 = mtbench_questions()[0][1]
    mtbench = {" ".join(q.split()) for _, q in mtbench_questions()}
    kw = dict(stops=stops, specials=specials, tokenizer=tok, mtbench=mtbench)
    good = tok.encode("How do magnets work?")
    assert wq.keep_question(good + [stop], True, **kw) == ("How do magnets work?", None)
    assert wq.keep_question(good, False, **kw) == (None, "unfinished")
    assert wq.keep_question(tok.encode("  \n") + [stop], True, **kw) == (None, "empty")
    assert wq.keep_question(good + [min(specials)] + [stop], True, **kw) == (None, "special_token")
    spaced = tok.encode("  " + q81.replace(" ", "  ") + "\n")
    assert wq.keep_question(spaced + [stop], True, **kw) == (None, "mtbench")
    assert wq.keep_question(spaced + [stop], True, **{**kw, "mtbench": None})[1] is None


# canned samples: (text, finished); None text is a special token in the middle
_CANNED = [("What is a prime number?", True), ("Tell me a joke.", True), ("unfinished question", False),
           ("", True), (None, True), ("What is a prime number?", True), ("Plan a trip to Rome.", True)]


def _fake_generate(tok, calls):
    stop = min(stop_token_ids(tok, "qwen3"))
    special = tok.token_id("<|im_start|>")

    def generate(target, prompts, *, max_new_tokens, stop_ids, pad_id, temperature, top_p, generator, vocab_limit):
        calls.append((prompts[0], len(prompts), temperature, top_p, generator.initial_seed()))
        out = []
        for _ in prompts:  # the generator decides, as sampling would
            text, finished = _CANNED[int(torch.randint(len(_CANNED), (1,), generator=generator))]
            ids = tok.encode("Hi") + [special] if text is None else tok.encode(text)
            out.append((ids + [stop] if finished else ids, finished))
        return out

    return generate


def _run(out, target, *extra):
    wq.main(["--target", target, "--out", str(out), "--num-questions", "10", "--batch-size", "3",
             "--dtype", "float32", "--no-cuda-graphs", "--seed", "5", *extra])
    with open(out / "part-00000.jsonl") as f:
        rows = [json.loads(line) for line in f]
    with open(out / "meta" / "settings-00000.json") as f:
        return rows, json.load(f)


def test_script_counts_resumes_and_refuses_other_settings(tmp_path, random_target_dir, tok, monkeypatch):
    calls = []
    monkeypatch.setattr(wq, "generate", _fake_generate(tok, calls))
    rows, settings = _run(tmp_path / "a", random_target_dir)
    chat = resolve_chat_format(tok, template="auto", system_prompt="auto")
    assert {c[0] == user_turn_prefix(tok, chat.template, chat.system_prompt) for c in calls} == {True}
    assert [(n, seed) for _, n, _, _, seed in calls] == [(3, 5), (3, 6), (3, 7), (1, 8)]  # seed + batch
    c = settings["counts"]
    assert c["sampled"] == 10 and c["written"] == len(rows) == 10 - c["unfinished"] - c["empty"] - c["special_token"]
    assert c["unfinished"] + c["empty"] + c["special_token"] > 0  # the seeds above draw some of each kind
    assert all(r["conversations"][0]["value"] in {t for t, _ in _CANNED if t} for r in rows)
    assert settings["distinct"] == len({r["conversations"][0]["value"] for r in rows})
    assert [r["question"] for r in rows] == sorted(r["question"] for r in rows)

    # stopped at the third batch, with a row of it written but not its record, and a cut line:
    # resumes to the same file and counts
    real = _fake_generate(tok, [])
    seen = []

    def stop_at_third(*args, **kwargs):
        seen.append(1)
        if len(seen) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(wq, "generate", stop_at_third)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path / "b", random_target_dir)
    with open(tmp_path / "b" / "part-00000.jsonl", "a") as f:
        f.write(json.dumps({"conversations": [{"from": "human", "value": "x"}], "question": 6, "batch": 2}) + "\n")
        f.write('{"conversations": [{"from": "human", "value": "half a li')
    monkeypatch.setattr(wq, "generate", _fake_generate(tok, calls := []))
    rows_b, settings_b = _run(tmp_path / "b", random_target_dir)
    assert [seed for *_, seed in calls] == [7, 8]  # only the batches not recorded as done
    assert rows_b == rows and settings_b["counts"] == c

    with pytest.raises(SystemExit, match="top_p 0.95 -> 0.8"):
        _run(tmp_path / "b", random_target_dir, "--top-p", "0.8")


def test_ranks_write_alternate_batches(tmp_path, random_target_dir, tok, monkeypatch):
    for rank in (0, 1):
        calls = []
        monkeypatch.setattr(wq, "generate", _fake_generate(tok, calls))
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        wq.main(["--target", random_target_dir, "--out", str(tmp_path), "--num-questions", "10", "--batch-size", "3",
                 "--dtype", "float32", "--no-cuda-graphs"])
        assert [seed for *_, seed in calls] == ([0, 2] if rank == 0 else [1, 3])
    assert sorted(os.listdir(tmp_path)) == ["meta", "part-00000.jsonl", "part-00001.jsonl"]


def test_questions_are_a_source_regenerate_data_answers(tmp_path, random_target_dir, tok, monkeypatch):
    monkeypatch.setattr(wq, "generate", _fake_generate(tok, []))
    rows, _ = _run(tmp_path / "q", random_target_dir)
    regenerate(["--target", random_target_dir, "--source", str(tmp_path / "q"), "--out", str(tmp_path / "r"),
                "--max-new-tokens", "4", "--dtype", "float32", "--tag", "self"])
    answered, _ = load_rows(str(tmp_path / "r"))
    asked = [r["conversations"][0]["value"] for r in rows]
    assert [r["conversations"][0]["value"] for r in answered] == list(dict.fromkeys(asked))  # each once
    assert all(r["conversations"][1]["from"] == "gpt" for r in answered)


def test_bad_settings_are_refused_in_one_line(tmp_path, random_target_dir):
    with pytest.raises(SystemExit, match="--temperature > 0"):
        wq.main(["--target", random_target_dir, "--out", str(tmp_path), "--num-questions", "4", "--temperature", "0"])
