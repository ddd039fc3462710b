"""Row sources (.json, .jsonl, folders, packaged ShareGPT) and row normalization (ShareGPT and
OpenAI messages, skip reasons)."""

import json
import logging

import pytest

from titan_draft.data.chat.template import Turn
from titan_draft.data.sources.files import _iter_json_list
from titan_draft.data.sources.rows import (
    BAD_JSON,
    SKIP_REASONS,
    load_rows,
    normalize_row,
    prompt_key,
    split_rows,
)


def _row(i):
    return {"id": i, "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}


def _msg_row(i):
    return {"id": i, "messages": [{"role": "user", "content": f"q{i}"},
                                  {"role": "assistant", "content": f"a{i}"}]}  # fmt: skip


def _conv(*turns):
    return {"conversations": [{"from": f, "value": v} for f, v in turns]}


def _msgs(*messages):
    return {"messages": [m if isinstance(m, dict) else {"role": m[0], "content": m[1]}
                         for m in messages]}  # fmt: skip


def test_normalize_sharegpt_roles():
    row = _conv(("system", "S"), ("human", "q"), ("gpt", "a"), ("user", "q2"), ("chatgpt", "a2"),
                ("USER", "q3"), ("assistant", "a3"))  # fmt: skip
    assert normalize_row(row) == [
        Turn("system", "S"), Turn("user", "q"), Turn("assistant", "a"), Turn("user", "q2"),
        Turn("assistant", "a2"), Turn("user", "q3"), Turn("assistant", "a3"),
    ]  # fmt: skip


def test_normalize_openai_messages():
    row = _msgs(
        ("system", "S"),
        ("user", [{"type": "text", "text": "Look "}, {"type": "text", "text": "here"}]),
        {"role": "assistant", "content": "Done.", "reasoning_content": "think", "tool_calls": []},
        {"role": "user", "content": "q2", "reasoning_content": 5},  # only read on assistants
        {"role": "assistant", "content": "<think>r</think>a2"},
    )
    assert normalize_row(row) == [
        Turn("system", "S"), Turn("user", "Look here"), Turn("assistant", "Done.", "think"),
        Turn("user", "q2"), Turn("assistant", "<think>r</think>a2", None),
    ]  # fmt: skip


def test_normalize_trims_to_first_user_and_last_assistant():
    # ShareGPT V3 pieces of a split conversation start with the answer to a lost question.
    row = _conv(("system", "S"), ("gpt", "lost"), ("human", "q"), ("gpt", "a"), ("human", "more?"))
    assert normalize_row(row) == [Turn("system", "S"), Turn("user", "q"), Turn("assistant", "a")]
    assert normalize_row(_msgs(("assistant", "x"), ("user", "q"), ("assistant", "a"))) == [
        Turn("user", "q"), Turn("assistant", "a")
    ]  # fmt: skip


@pytest.mark.parametrize(
    "row, reason",
    [
        (BAD_JSON, "bad_json"),
        ({"id": 1}, "no_conversations"),
        ({"conversations": []}, "no_conversations"),
        ({"conversations": "hi"}, "no_conversations"),
        ({"messages": None}, "no_conversations"),
        ([1, 2], "no_conversations"),
        (_conv(("human", "q"), ("bing", "a")), "unknown_role"),
        ({"conversations": [{"value": "q"}]}, "unknown_role"),
        (_msgs(("developer", "d"), ("user", "q"), ("assistant", "a")), "unknown_role"),
        (_msgs(("user", "q"), ("tool", "42"), ("assistant", "a")), "tool_use"),
        (_conv(("human", "q"), ("function_call", "{}"), ("gpt", "a")), "tool_use"),
        ({**_msgs(("user", "q"), ("assistant", "a")), "tools": [{"type": "function", "function": {"name": "f"}}]},
         "tool_use"),  # fmt: skip
        (_msgs(("user", "q"), {"role": "assistant", "content": None,
                               "tool_calls": [{"function": {"name": "f"}}]}),
         "tool_use"),  # fmt: skip
        (_conv(("human", "q"), ("gpt", "  \n")), "empty_turn"),
        (_conv(("human", ""), ("gpt", "a")), "empty_turn"),
        (_msgs(("user", []), ("assistant", "a")), "empty_turn"),
        (_conv(("human", "q"), ("gpt", ["a", "b"])), "non_text_content"),
        (_conv(("human", "q"), ("gpt", None)), "non_text_content"),
        ({"conversations": ["q", "a"]}, "non_text_content"),
        (_msgs(("user", [{"type": "text", "text": "what is this?"},
                         {"type": "image_url", "image_url": {"url": "x.png"}}]),
               ("assistant", "a cat")), "non_text_content"),  # fmt: skip
        (_msgs(("user", "q"), {"role": "assistant", "content": "a", "reasoning_content": ["r"]}),
         "non_text_content"),  # fmt: skip
        (_msgs(("user", "q"), ("system", "s"), ("assistant", "a")), "misplaced_system"),
        (_msgs(("system", "s"), ("system", "t"), ("user", "q"), ("assistant", "a")),
         "misplaced_system"),  # fmt: skip
        (_conv(("human", "q"), ("human", "q2"), ("gpt", "a")), "consecutive_same_role"),
        (_conv(("human", "q"), ("gpt", "a"), ("gpt", "a2")), "consecutive_same_role"),
        (_conv(("system", "s"), ("human", "q")), "no_assistant_turn"),
        (_conv(("gpt", "a"),), "no_assistant_turn"),
        (_conv(("system", "s"), ("gpt", "a"), ("human", "q")), "no_assistant_turn"),
    ],
)
def test_normalize_skip_reasons(row, reason):
    assert reason in SKIP_REASONS
    assert normalize_row(row) == reason


def test_jsonl_bad_line_and_blank_lines(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text(json.dumps(_row(0)) + "\n{not json\n\n" + json.dumps(_row(1)) + "\n")
    rows, total = load_rows(str(p))
    assert total == 3
    assert rows[0]["id"] == 0 and rows[1] is BAD_JSON and rows[2]["id"] == 1


def test_folder_sorted_max_rows_and_sharding(tmp_path):
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(_row(i)) + "\n" for i in range(3, 6)))
    (tmp_path / "a.json").write_text(json.dumps([_row(i) for i in range(3)]))
    (tmp_path / "notes.txt").write_text("ignored")
    rows, total = load_rows(str(tmp_path))
    assert total == 6 and [r["id"] for r in rows] == list(range(6))
    rows, total = load_rows(str(tmp_path), max_rows=4)
    assert total == 4 and [r["id"] for r in rows] == [0, 1, 2, 3]
    r0, _ = load_rows(str(tmp_path), max_rows=5, dp_rank=0, dp_world=2)
    r1, _ = load_rows(str(tmp_path), max_rows=5, dp_rank=1, dp_world=2)
    assert [r["id"] for r in r0] == [0, 2, 4] and [r["id"] for r in r1] == [1, 3]


def test_folder_of_both_row_forms(tmp_path, caplog):
    def lines(rows):
        return "".join(json.dumps(row) + "\n" for row in rows)

    (tmp_path / "a_sharegpt.jsonl").write_text(lines(_row(i) for i in range(2)))
    (tmp_path / "b_openai.json").write_text(json.dumps([_msg_row(i) for i in range(2, 4)]))
    # JSON Lines under a .json name is read as JSON Lines.
    (tmp_path / "c_openai_lines.json").write_text(lines(_msg_row(i) for i in (4, 5)))
    (tmp_path / "nested").mkdir()  # not read, and said so
    (tmp_path / "nested" / "d.jsonl").write_text(json.dumps(_row(99)) + "\n")
    with caplog.at_level(logging.INFO, logger="titan_draft.data.sources.files"):
        rows, total = load_rows(str(tmp_path))
    assert "subfolders" in caplog.text and "nested" in caplog.text
    assert total == 6 and [r["id"] for r in rows] == list(range(6))
    for i, row in enumerate(rows):
        assert normalize_row(row) == [Turn("user", f"q{i}"), Turn("assistant", f"a{i}")]


def test_bad_sources(tmp_path):
    with pytest.raises(ValueError, match=r"data\.source: .*does not exist"):
        load_rows(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"data\.source: .*has no rows"):
        load_rows(str(tmp_path / "empty.jsonl"))
    (tmp_path / "empty.json").write_text("[ ]")
    with pytest.raises(ValueError, match=r"data\.source: .*has no rows"):
        load_rows(str(tmp_path / "empty.json"))
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match=r"data\.source: folder .*no \.json"):
        load_rows(str(tmp_path / "sub"))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"data\.source: .*d\.csv"):
        load_rows(str(tmp_path / "d.csv"))
    (tmp_path / "obj.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match=r"data\.source: .*not a JSON list"):
        load_rows(str(tmp_path / "obj.json"))
    (tmp_path / "obj.json").write_text(json.dumps(_row(0), indent=2) + "\n")  # one object
    with pytest.raises(ValueError, match=r"data\.source: .*not a JSON list"):
        load_rows(str(tmp_path / "obj.json"))
    # Once recognized as JSON Lines, a bad line is a counted row, as in a .jsonl.
    (tmp_path / "obj.json").write_text(json.dumps(_row(0)) + "\n{bad\n")
    assert load_rows(str(tmp_path / "obj.json"))[0] == [_row(0), BAD_JSON]


def test_truncated_json(tmp_path):
    p = tmp_path / "cut.json"
    full = json.dumps([_row(0), _row(1), _row(2)], indent=2)
    p.write_text(full[: full.index('"q2"') + 2])  # cut inside the third row
    with pytest.raises(ValueError, match=r"data\.source: .*cut\.json is not valid JSON"):
        load_rows(str(p))
    rows = list(_iter_json_list(p, allow_truncated=True))
    assert [r["id"] for r in rows[:2]] == [0, 1] and rows[2] is BAD_JSON and len(rows) == 3
    # Corruption in the middle of a complete file is never tolerated.
    p.write_text(full.replace('"q1"', "q1"))
    with pytest.raises(ValueError, match="not valid JSON"):
        list(_iter_json_list(p, allow_truncated=True))


def test_packaged_sharegpt():
    rows, total = load_rows("sharegpt", max_rows=40, dp_rank=1, dp_world=2)
    assert total == 40 and len(rows) == 20
    turns = normalize_row(rows[0])
    assert isinstance(turns, list) and turns[0][0] == "user"
    assert any(turn.role == "assistant" for turn in turns)
    first, _ = load_rows("sharegpt", max_rows=1)
    assert first[0]["id"] == "QWJhYvA_0"


def _asks(q, a="x", system=None):
    turns = ([("system", system)] if system else []) + [("human", q), ("gpt", a)]
    return _conv(*turns)


def test_held_out_prompts_are_never_trained_on(tmp_path):
    # rows 0-2 are held out; later rows asking "continue" or "hi" (their prompts) are left out too,
    # even with another answer; another system turn makes another prompt; repeats of a training
    # prompt stay (only held-out prompts are kept apart)
    rows = [_asks("continue"), _asks("hi"), _conv(("gpt", "no prompt")),
            _asks("q3"), _asks("continue", "other answer"), _asks("q5"), _asks("hi"),
            _asks("hi", system="be brief"), _asks("q5"), _asks("q9")]
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    split = split_rows(str(p), skip_rows=3)
    assert split.positions == [3, 5, 7, 8, 9] and split.total == 5 and split.held_out_repeats == 2
    assert split.rows == [rows[i] for i in split.positions]
    assert load_rows(str(p), skip_rows=3) == (split.rows, 5)
    # DP ranks split the remaining rows, disjoint and together all of them
    parts = [split_rows(str(p), skip_rows=3, dp_rank=r, dp_world=2) for r in (0, 1)]
    assert [s.positions for s in parts] == [[3, 7, 9], [5, 8]] and {s.total for s in parts} == {5}
    # max_rows counts the rows kept
    assert split_rows(str(p), skip_rows=3, max_rows=2).positions == [3, 5]
    # without held-out rows nothing is left out
    assert split_rows(str(p)).positions == list(range(10))
    assert prompt_key(rows[4]) == prompt_key(rows[0]) == (("user", "continue"),)
    assert prompt_key(rows[2]) is None and prompt_key(BAD_JSON) is None


def test_held_out_repeats_that_leave_nothing_are_named(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(_asks("continue")) + "\n" for _ in range(4)))
    with pytest.raises(ValueError, match=r"no rows after the 1 held-out rows \(data.holdout_rows\) and the 3 that"):
        load_rows(str(p), skip_rows=1)
