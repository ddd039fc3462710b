"""Eval prompts: rendered as the training renderer starts an answer, from MT-Bench, held-out rows
(which training never reads) and JSONL files."""

from __future__ import annotations

import json

import pytest

from titan_draft.data.chat.template import Turn, render_chat
from titan_draft.data.chat.prompts import load_eval_prompts, mtbench_questions, render_prompt, stop_token_ids
from titan_draft.data.sources.rows import load_rows


CONVERSATIONS = [
    [Turn("user", "What is 2+2? Answer briefly.")],
    [Turn("system", "Be exact."), Turn("user", "Name three primes.\n")],
]


@pytest.mark.parametrize("template,thinking", [("chatml", True), ("qwen3", True), ("qwen3", False)])
@pytest.mark.parametrize("turns", CONVERSATIONS)
def test_prompt_ends_where_training_loss_starts(tok, template, thinking, turns):
    prompt = render_prompt(turns, tok, template, "You are kind.", enable_thinking=thinking)
    ids, mask = render_chat([*turns, Turn("assistant", "Four.")], tok, template, "You are kind.",
                            enable_thinking=thinking)
    first_trained = mask.index(True)
    assert prompt == ids[:first_trained]
    text = tok.decode(prompt)
    assert text.endswith("<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
    assert ("You are kind." in text) == (turns[0].role != "system")
    with pytest.raises(ValueError, match="end with a user turn"):
        render_prompt([*turns, Turn("assistant", "x")], tok, template)


def test_mtbench_first_turns():
    questions = mtbench_questions()
    assert [qid for qid, _ in questions] == list(range(81, 161))
    assert questions[0][1].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _conv(i):
    return {"conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"answer {i}"}]}


def test_holdout_rows_are_never_trained_on(tmp_path, tok):
    source = _jsonl(tmp_path / "chats.jsonl", [_conv(i) for i in range(10)])
    held = load_eval_prompts(["holdout"], tok, template="chatml", system_prompt="", enable_thinking=True,
                             num_prompts=0, data_source=source, holdout_rows=3)
    assert [p.name for p in held] == ["holdout:0", "holdout:1", "holdout:2"]
    assert [tok.decode(p.ids).split("question ")[1][0] for p in held] == ["0", "1", "2"]
    trained = []
    for rank in range(2):
        rows, total = load_rows(source, dp_rank=rank, dp_world=2, skip_rows=3)
        assert total == 7
        trained += [r["conversations"][0]["value"] for r in rows]
    assert sorted(trained) == [f"question {i}" for i in range(3, 10)]
    rows, total = load_rows(source, max_rows=2, skip_rows=3)
    assert total == 2 and rows[0]["conversations"][0]["value"] == "question 3"
    with pytest.raises(ValueError, match="no rows after the 10 held-out rows"):
        load_rows(source, skip_rows=10)
    with pytest.raises(ValueError, match="data.holdout_rows > 0"):
        load_eval_prompts(["holdout"], tok, template="chatml", system_prompt="", enable_thinking=True,
                          num_prompts=0, data_source=source, holdout_rows=0)


def test_holdout_prompts_repeated_in_the_source_are_asked_once(tmp_path, tok):
    # held-out rows 0-3 ask question 0 twice; training then also leaves out rows 4 and 6, which
    # ask held-out questions again
    source = _jsonl(tmp_path / "chats.jsonl", [_conv(i) for i in (0, 1, 0, 2, 0, 5, 1, 7)])
    held = load_eval_prompts(["holdout"], tok, template="chatml", system_prompt="", enable_thinking=True,
                             num_prompts=0, data_source=source, holdout_rows=4)
    assert [p.name for p in held] == ["holdout:0", "holdout:1", "holdout:3"]
    rows, total = load_rows(source, skip_rows=4)
    assert total == 2 and [r["conversations"][0]["value"] for r in rows] == ["question 5", "question 7"]


def test_jsonl_prompts_limits_and_errors(tmp_path, tok):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "short"}, _conv(1), {"prompt": "x " * 200}])
    kw = dict(template="chatml", system_prompt="", enable_thinking=True)
    got = load_eval_prompts([path], tok, num_prompts=0, **kw)
    assert [p.name for p in got] == ["p.jsonl:1", "p.jsonl:2", "p.jsonl:3"]
    assert tok.decode(got[1].ids) == "<|im_start|>user\nquestion 1<|im_end|>\n<|im_start|>assistant\n"
    assert len(load_eval_prompts([path], tok, num_prompts=0, max_prompt_tokens=50, **kw)) == 2
    assert len(load_eval_prompts([path, path], tok, num_prompts=1, **kw)) == 2
    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"neither": 1}])
    with pytest.raises(ValueError, match="bad.jsonl line 2 is neither"):
        load_eval_prompts([bad], tok, num_prompts=0, **kw)
    with pytest.raises(ValueError, match="'nope' is not one of mtbench, holdout"):
        load_eval_prompts(["nope"], tok, num_prompts=0, **kw)


def test_stop_tokens(tok):
    assert stop_token_ids(tok, "qwen3") == [tok.token_id("<|im_end|>")]


def test_first_query_of_question_only_rows():
    from titan_draft.data.chat.prompts import first_query

    q = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q1"}]}
    assert first_query(q) == [Turn("system", "S"), Turn("user", "Q1")]
    full = {"conversations": [{"from": "gpt", "value": "orphan"}, {"from": "human", "value": "Q1"},
                              {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"}]}
    assert first_query(full) == [Turn("user", "Q1")]
    assert first_query({"conversations": [{"from": "gpt", "value": "only an answer"}]}) is None
    assert first_query({"conversations": [{"from": "human", "value": " "}]}) is None
