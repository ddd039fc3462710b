"""scripts/regenerate_data.py: batched, left-padded generation answers as one-at-a-time greedy
decoding does, and its output folder trains as a data.source."""

from __future__ import annotations

import json
import os

import pytest
import torch

from scripts.regenerate_data import batch_order, generate, main, own_answers
from titan_draft import load_target
from titan_draft.decoding.speculative import greedy_decode
from titan_draft.data.chat.template import Turn
from titan_draft.data.chat.prompts import render_prompt, stop_token_ids
from titan_draft.data.sources.rows import load_rows
from titan_draft.data.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def target(random_target_dir):
    return load_target(random_target_dir, dtype=torch.float64)


def test_batched_greedy_equals_one_at_a_time(target):
    prompts = [[5, 9, 11, 2], [7, 7, 3, 1, 8, 20, 4, 6, 6], [30, 1]]
    plain = [greedy_decode(target, p, 12, [], torch.device("cpu")).tokens for p in prompts]
    stop = plain[1][4]  # a token that ends the second answer early
    got = generate(target, prompts, max_new_tokens=12, stop_ids=[stop], pad_id=0)
    for p, (tokens, finished), full in zip(prompts, got, plain):
        want = full[: full.index(stop) + 1] if stop in full else full
        assert tokens == want and finished == (stop in full)
    assert got[1][1] is True


def test_sampling_is_seeded(target):
    prompts = [[5, 9, 11, 2], [30, 1]]

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return generate(target, prompts, max_new_tokens=10, stop_ids=[], pad_id=0, temperature=1.0, top_p=0.9,
                        generator=g)

    assert run(3) == run(3) != run(4)


def _chats(path, n):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"Tell me about {i}."},
                                                  {"from": "gpt", "value": "old answer"}]}) + "\n")
    return str(path)


def test_script_writes_a_source_and_resumes(tmp_path, random_target_dir, capsys):
    source = _chats(tmp_path / "chats.jsonl", 6)
    out = tmp_path / "regen"
    argv = ["--target", random_target_dir, "--out", str(out), "--source", source, "--skip-rows", "2",
            "--num-prompts", "3", "--max-new-tokens", "5", "--batch-size", "2", "--dtype", "float32"]
    main(argv)
    rows, total = load_rows(str(out))
    assert total == 3 and sorted(r["source_row"] for r in rows) == [2, 3, 4]
    tok = build_tokenizer(random_target_dir)
    target = load_target(random_target_dir, dtype=torch.float32)
    for row in rows:
        question, answer = row["conversations"]
        assert question == {"from": "human", "value": f"Tell me about {row['source_row']}."}
        prompt = render_prompt([Turn("user", question["value"])], tok, "qwen3", enable_thinking=False)
        want = greedy_decode(target, prompt, 5, stop_token_ids(tok, "qwen3"), torch.device("cpu")).tokens
        assert answer == {"from": "gpt", "value": tok.decode(want)} and row["finished"] is False
    settings = json.loads((out / "meta" / "settings-00000.json").read_text())
    assert settings["answered"] == 3 and settings["skip_rows"] == 2 and settings["temperature"] == 0.0
    main(argv)  # nothing left to answer: no row is written twice
    assert load_rows(str(out))[1] == 3
    assert json.loads((out / "meta" / "settings-00000.json").read_text())["already_done"] == 3
    assert "subfolders" not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="does not exist"):
        main(["--target", random_target_dir, "--out", str(out), "--source", str(tmp_path / "nope.jsonl")])
    assert os.path.isfile(out / "part-00000.jsonl")


def test_budget_and_a_cut_line_resume(tmp_path, random_target_dir):
    source = _chats(tmp_path / "chats.jsonl", 4)
    out = tmp_path / "regen"
    argv = ["--target", random_target_dir, "--out", str(out), "--source", source, "--max-new-tokens", "3",
            "--batch-size", "2", "--dtype", "float32"]
    main(argv + ["--max-seconds", "1e-9"])  # the budget is spent before the first batch
    settings = json.loads((out / "meta" / "settings-00000.json").read_text())
    assert settings["answered"] == 0 and settings["left"] == 4
    main(argv)
    part = out / "part-00000.jsonl"
    lines = part.read_text().splitlines()
    part.write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])  # an interruption cut the last row
    main(argv)
    rows = [json.loads(line) for line in part.read_text().splitlines()]
    assert [r["source_row"] for r in rows] == [0, 1, 2, 3]  # re-answered, in source order
    assert json.loads((out / "meta" / "settings-00000.json").read_text())["answered"] == 1


def test_ranks_split_the_prompts(tmp_path, random_target_dir, monkeypatch):
    """Under torchrun rank r answers rows r, r + W, ...: two ranks together answer each row once."""
    source = _chats(tmp_path / "chats.jsonl", 5)
    out = tmp_path / "regen"
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        main(["--target", random_target_dir, "--out", str(out), "--source", source, "--max-new-tokens", "2",
              "--dtype", "float32"])
    parts = [[json.loads(line)["source_row"] for line in (out / f"part-0000{r}.jsonl").read_text().splitlines()]
             for r in (0, 1)]
    assert parts == [[0, 2, 4], [1, 3]]
    assert load_rows(str(out))[1] == 5


def _asking(path, questions):
    with open(path, "w") as f:
        for q in questions:
            f.write(json.dumps({"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "old"}]}) + "\n")
    return str(path)


@pytest.mark.parametrize("temperature", ["0", "1.0"])
def test_repeated_and_held_out_prompts(tmp_path, random_target_dir, temperature):
    """Row 0 is held out: row 2, asking its prompt again, is never answered. Row 4 (row 1's
    prompt again) is answered once a pass, as row 1, greedy or sampled."""
    answered = [1, 3, 5]
    questions = ["q0", "q1", "q0", "q2", "q1", "q3"]
    source = _asking(tmp_path / "chats.jsonl", questions)
    out = tmp_path / "regen"
    main(["--target", random_target_dir, "--out", str(out), "--source", source, "--skip-rows", "1",
          "--max-new-tokens", "2", "--dtype", "float32", "--temperature", temperature])
    rows, _ = load_rows(str(out))
    assert [r["source_row"] for r in rows] == answered
    assert [r["conversations"][0]["value"] for r in rows] == [questions[i] for i in answered]
    settings = json.loads((out / "meta" / "settings-00000.json").read_text())
    assert settings["held_out_repeats"] == 1 and settings["repeated_prompts"] == 1


def test_a_tagged_pass_adds_answers_behind_the_first(tmp_path, random_target_dir):
    """A sampled pass with --tag writes its own part beside the greedy one and resumes on its own;
    the folder then reads greedy rows first (the held-out ones stay the first rows), then the
    pass's answers to the same prompts."""
    source = _chats(tmp_path / "chats.jsonl", 4)
    out = tmp_path / "regen"
    base = ["--target", random_target_dir, "--out", str(out), "--source", source, "--max-new-tokens", "4",
            "--dtype", "float32"]
    main(base)
    sampled = base + ["--skip-rows", "1", "--temperature", "1.0", "--seed", "7", "--tag", "t10"]
    main(sampled)
    assert sorted(p.name for p in out.iterdir()) == ["meta", "part-00000.jsonl", "part-t10-00000.jsonl"]
    rows, total = load_rows(str(out))
    assert total == 7 and [r["source_row"] for r in rows] == [0, 1, 2, 3, 1, 2, 3]
    settings = json.loads((out / "meta" / "settings-t10-00000.json").read_text())
    assert settings["tag"] == "t10" and settings["answered"] == 3 and settings["temperature"] == 1.0
    main(sampled)  # resumes from its own part: nothing answered twice
    assert load_rows(str(out))[1] == 7
    assert json.loads((out / "meta" / "settings-t10-00000.json").read_text())["already_done"] == 3
    assert json.loads((out / "meta" / "settings-00000.json").read_text())["answered"] == 4
    for bad in ("7x", "a/b", "_a"):
        with pytest.raises(SystemExit, match="--tag"):
            main(base + ["--tag", bad])


def test_batch_order_sorts_within_windows_of_the_source():
    # prompt lengths falling along the source: a whole-list sort would answer the last rows first
    todo = [(i, None, [0] * (100 - i)) for i in range(40)]
    got = batch_order(todo, batch_size=2, window_batches=4)
    assert sorted(got) == sorted(todo)
    for w in range(0, 40, 8):  # each window of 8 holds its own source rows, shortest first
        window = got[w : w + 8]
        assert {i for i, _, _ in window} == set(range(w, w + 8))
        assert [len(ids) for _, _, ids in window] == sorted(len(ids) for _, _, ids in window)


def test_a_later_turn_is_asked_after_the_targets_own_answers(tmp_path, random_target_dir):
    """--turn 2 asks each conversation's second question after the target's greedy answer to the
    first (from the greedy pass in --out, never the source's answer nor a sampled pass's), and
    its answer is what one-at-a-time greedy decoding gives for that history."""
    path = tmp_path / "chats.jsonl"
    convs = [[("human", f"first {i}"), ("gpt", "source answer"), ("human", f"second {i}"), ("gpt", "x")]
             for i in range(3)] + [[("human", "only one"), ("gpt", "y")]]
    with open(path, "w") as f:
        for conv in convs:
            f.write(json.dumps({"conversations": [{"from": s, "value": v} for s, v in conv]}) + "\n")
    out = tmp_path / "regen"
    base = ["--target", random_target_dir, "--out", str(out), "--source", str(path), "--max-new-tokens", "3",
            "--dtype", "float32"]
    main(base + ["--num-prompts", "2"])  # greedy answers to rows 0 and 1 only
    # the random target answers with whitespace, which is no turn; give the greedy pass's rows text
    part = out / "part-00000.jsonl"
    greedy = [json.loads(line) for line in part.read_text().splitlines()]
    for r in greedy:
        r["conversations"][1]["value"] = f"own answer {r['source_row']}"
    part.write_text("".join(json.dumps(r) + "\n" for r in greedy))
    main(base + ["--temperature", "1.0", "--tag", "t10"])  # a sampled answer to every row
    sampled = out / "part-t10-00000.jsonl"
    rows = [json.loads(line) for line in sampled.read_text().splitlines()]
    for r in rows:
        r["conversations"][1]["value"] = f"sampled answer {r['source_row']}"
    sampled.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="--turn 2"):
        main(base + ["--turn", "2"])
    main(base + ["--turn", "2", "--tag", "turn2"])
    greedy = {r["source_row"]: r["conversations"][1]["value"] for r in greedy}
    rows = [json.loads(line) for line in (out / "part-turn2-00000.jsonl").read_text().splitlines()]
    assert [r["source_row"] for r in rows] == [0, 1] and all(r["turn"] == 2 for r in rows)
    tok = build_tokenizer(random_target_dir)
    target = load_target(random_target_dir, dtype=torch.float32)
    for row in rows:
        i = row["source_row"]
        history = [Turn("user", f"first {i}"), Turn("assistant", greedy[i]), Turn("user", f"second {i}")]
        speakers = {"user": "human", "assistant": "gpt"}
        assert row["conversations"][:3] == [{"from": speakers[t.role], "value": t.content} for t in history]
        prompt = render_prompt(history, tok, "qwen3", enable_thinking=False)
        want = greedy_decode(target, prompt, 3, stop_token_ids(tok, "qwen3"), torch.device("cpu")).tokens
        assert row["conversations"][3] == {"from": "gpt", "value": tok.decode(want)}
    settings = json.loads((out / "meta" / "settings-turn2-00000.json").read_text())
    assert settings["turn"] == 2 and settings["answered"] == 2
    # a history is only taken from passes rendered as this one is
    fmt = (settings["chat_template"], settings["system_prompt"])
    assert own_answers(str(out), *fmt, False)[(("user", "first 0"),)] == greedy[0]
    assert own_answers(str(out), *fmt, True) == {} and own_answers(str(out), "chatml", fmt[1], False) == {}
    assert settings["no_own_answer"] == 1 and settings["fewer_turns"] == 1  # row 2: sampled only; row 3
