"""Row sources (.json, .jsonl, folders, packaged ShareGPT) and ShareGPT normalization."""

import json

import pytest

from titan_draft.data.sources import BAD_JSON, _iter_json_list, load_rows, normalize_sharegpt


def _row(i):
    return {"id": i, "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}


def _conv(*turns):
    return {"conversations": [{"from": f, "value": v} for f, v in turns]}


def test_normalize_roles():
    row = _conv(("system", "S"), ("human", "q"), ("gpt", "a"), ("user", "q2"), ("chatgpt", "a2"),
                ("USER", "q3"), ("assistant", "a3"))  # fmt: skip
    assert normalize_sharegpt(row) == [
        ("system", "S"), ("user", "q"), ("assistant", "a"), ("user", "q2"), ("assistant", "a2"),
        ("user", "q3"), ("assistant", "a3"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "row, reason",
    [
        (BAD_JSON, "bad_json"),
        ({"id": 1}, "no_conversations"),
        ({"conversations": []}, "no_conversations"),
        ({"conversations": "hi"}, "no_conversations"),
        ([1, 2], "no_conversations"),
        (_conv(("human", "q"), ("bing", "a")), "unknown_role"),
        ({"conversations": [{"value": "q"}]}, "unknown_role"),
        (_conv(("human", "q"), ("gpt", "  \n")), "empty_turn"),
        (_conv(("human", ""), ("gpt", "a")), "empty_turn"),
        (_conv(("human", "q"), ("gpt", ["a", "b"])), "non_text_content"),
        (_conv(("human", "q"), ("gpt", None)), "non_text_content"),
        ({"conversations": ["q", "a"]}, "non_text_content"),
        (_conv(("system", "s"), ("human", "q")), "no_assistant_turn"),
    ],
)
def test_normalize_skip_reasons(row, reason):
    assert normalize_sharegpt(row) == reason


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
    turns = normalize_sharegpt(rows[0])
    assert isinstance(turns, list) and turns[0][0] == "user"
    assert any(role == "assistant" for role, _ in turns)
    first, _ = load_rows("sharegpt", max_rows=1)
    assert first[0]["id"] == "QWJhYvA_0"
