"""The torchdata pipeline: resume, DP sharding, shuffling, skip counts, padding, config errors."""

import json
import re
import time

import pytest
import torch

from titan_draft.config.job_config import Data
from titan_draft.config import ConfigError, JobConfig, validate_job_config
from titan_draft.data.pipeline import build_dataloader, collate_chat
from titan_draft.data.sources.rows import SKIP_REASONS

PAD = 151643


_BUILT: list = []


@pytest.fixture(autouse=True)
def _close_loaders():
    """Every loader a test builds is closed after it, as the trainer closes its own: a prefetch
    thread left running is otherwise collected later, in whatever thread the GC runs."""
    yield
    while _BUILT:
        _BUILT.pop().close()


def _conv(i, user="question"):
    return {"conversations": [{"from": "human", "value": f"{user} {i}"},
                              {"from": "gpt", "value": f"answer {i}"}]}  # fmt: skip


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def _build(tok, source, *, bs=3, rank=0, world=1, seed=7, static=False, pad_multiple=1, reserved=(), **data):
    data.setdefault("chat_template", "chatml")  # the lengths below were measured with it
    cfg = Data(source=source, max_length=data.pop("max_length", 64), **data)
    dl = build_dataloader(cfg, tok, dp_rank=rank, dp_world=world, local_batch_size=bs,
                          seed=seed, static_shapes=static, pad_multiple=pad_multiple,
                          reserved_ids=frozenset(reserved))  # fmt: skip
    _BUILT.append(dl)
    return dl


def _row_ids(batch, tok):
    """The row number of each sample, read back from its tokens."""
    out = []
    for ids, n in zip(batch["input_ids"], batch["valid_lengths"]):
        out.append(int(re.search(r"answer (\d+)", tok.decode(ids[:n].tolist())).group(1)))
    return out


def _take(dl, n):
    return [next(dl) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


def _wait_read_ahead(dl, consumed_state):
    """Block until the prefetch thread has read past what the training loop consumed."""
    deadline = time.time() + 10
    while dl._source.get_state()["chat_source"] == consumed_state:
        assert time.time() < deadline, "prefetcher never read ahead"
        time.sleep(0.01)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_is_exact_across_epochs(tok, tmp_path, prefetch):
    src = _write(tmp_path / "d.jsonl", [_conv(i) for i in range(10)])
    n, m = 5, 6  # 3 rows a batch: the state is taken in epoch 1, and the tail crosses into epoch 2
    ref = _take(_build(tok, src, prefetch_factor=prefetch), n + m)

    dl = _build(tok, src, prefetch_factor=prefetch)
    assert _same(_take(dl, n), ref[:n])
    sd = dl.state_dict()
    assert dl.epoch == 1
    if prefetch:
        _wait_read_ahead(dl, dl._source_state())
        assert dl.state_dict() == sd  # read-ahead does not move the consumed position

    fresh = _build(tok, src, prefetch_factor=prefetch)
    fresh.load_state_dict(sd)
    assert fresh.epoch == 1 and fresh.state_dict() == sd
    assert _same(_take(fresh, m), ref[n:])
    assert _same(_take(dl, m), ref[n:])  # the interrupted loader itself lost nothing either

    # DCP asks a fresh loader for its state_dict() (the structure to load into) before loading
    probed = _build(tok, src, prefetch_factor=prefetch)
    probed.state_dict()
    probed.load_state_dict(sd)
    assert probed.state_dict() == sd
    assert _same(_take(probed, m), ref[n:])


def test_dp_ranks_are_disjoint(tok, tmp_path):
    src = _write(tmp_path / "d.jsonl", [_conv(i) for i in range(11)])
    seen = []
    for rank in range(2):
        dl = _build(tok, src, bs=1, rank=rank, world=2)
        assert dl.rows_per_rank == (6, 5)[rank]
        ids = [i for b in _take(dl, dl.rows_per_rank) for i in _row_ids(b, tok)]
        assert sorted(ids) == list(range(rank, 11, 2))  # each owned row exactly once per epoch
        seen.append(set(ids))
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(11))


def test_shuffle_per_epoch_and_seed(tok, tmp_path):
    src = _write(tmp_path / "d.jsonl", [_conv(i) for i in range(12)])

    def order(seed, shuffle=True):
        dl = _build(tok, src, bs=4, seed=seed, shuffle=shuffle, prefetch_factor=0)
        return [i for b in _take(dl, 6) for i in _row_ids(b, tok)]

    a = order(1)
    e0, e1 = a[:12], a[12:]
    assert sorted(e0) == sorted(e1) == list(range(12))
    assert e0 != list(range(12)) and e0 != e1
    assert order(1) == a and order(2) != a
    assert order(1, shuffle=False) == list(range(12)) * 2


def test_bad_rows_skipped_and_counted(tok, tmp_path):
    long_user = "word " * 200  # > max_length tokens before the assistant turn
    lines = [
        _conv(0),
        "{this is not json",
        {"conversations": []},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "bard", "value": "a"}]},
        _conv(1),
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": [1]}]},
        {"conversations": [{"from": "human", "value": "q"}]},
        _conv(2, user=long_user),
        {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "42"},
                      {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"},
                      {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": "a"}]},
        _conv(4, user="a question holding <|fim_pad|>, the draft's mask token"),
        _conv(3),
    ]  # fmt: skip
    src = _write(tmp_path / "d.jsonl", lines)
    reserved = [tok.token_id("<|fim_pad|>")]
    dl = _build(tok, src, bs=1, shuffle=False, max_length=64, prefetch_factor=2, reserved=reserved)
    assert _row_ids(next(dl), tok) == [0]
    consumed = dl._source_state()
    _wait_read_ahead(dl, consumed)
    assert sum(dl.skip_counts.values()) == 0  # rows only the prefetcher has passed are not counted
    assert [_row_ids(next(dl), tok)[0] for _ in range(2)] == [1, 3]
    once = dict.fromkeys(SKIP_REASONS, 1)  # one row for every reason
    assert dl.skip_counts == once and list(once) == list(dl.skip_counts)
    sd = dl.state_dict()
    assert [_row_ids(next(dl), tok)[0] for _ in range(3)] == [0, 1, 3]
    assert dl.skip_counts == {k: 2 * v for k, v in once.items()}  # cumulative over epochs

    fresh = _build(tok, src, bs=1, shuffle=False, max_length=64, prefetch_factor=2, reserved=reserved)
    fresh.load_state_dict(sd)
    assert fresh.skip_counts == once and fresh.epoch == 1


def test_all_rows_unusable(tok, tmp_path):
    src = _write(tmp_path / "d.jsonl", ["{bad", {"conversations": []}])
    dl = _build(tok, src, bs=1, prefetch_factor=0)
    with pytest.raises(ValueError, match="none of this DP rank's 2 rows is usable"):
        next(dl)


def test_static_and_dynamic_padding(tok, tmp_path):
    long_answer = {"conversations": [{"from": "human", "value": "q"},
                                     {"from": "gpt", "value": "word " * 100}]}  # fmt: skip
    rows = [_conv(0), _conv(1, user="a much longer question " * 3), long_answer]
    src = _write(tmp_path / "d.jsonl", rows)
    static = next(_build(tok, src, static=True, shuffle=False, max_length=48))
    lengths = static["valid_lengths"].tolist()
    assert static["input_ids"].shape == (3, 48) and static["loss_mask"].shape == (3, 48)
    assert static["input_ids"].dtype == torch.long and static["loss_mask"].dtype == torch.bool
    assert lengths[2] == 48 and max(lengths[:2]) < 48  # truncated to max_length
    for i, n in enumerate(lengths):
        assert (static["input_ids"][i, n:] == PAD).all() and not static["loss_mask"][i, n:].any()
        assert static["loss_mask"][i, :n].any()

    short = _write(tmp_path / "s.jsonl", rows[:2])
    dyn = next(_build(tok, short, bs=2, shuffle=False, max_length=48, pad_multiple=16))
    longest = max(dyn["valid_lengths"].tolist())
    assert longest % 16 != 0 and dyn["input_ids"].shape == (2, -(-longest // 16) * 16)
    exact = next(_build(tok, short, bs=2, shuffle=False, max_length=48))
    assert exact["input_ids"].shape == (2, longest)
    assert torch.equal(exact["input_ids"], dyn["input_ids"][:, :longest])


def test_collate_chat():
    samples = [([5, 6, 7], [False, True, True]), ([1, 2, 3, 4, 5], [False] * 4 + [True])]
    b = collate_chat(samples, pad_id=PAD, max_length=16, static_shapes=False, pad_multiple=4)
    assert b["input_ids"].tolist() == [[5, 6, 7, PAD, PAD, PAD, PAD, PAD], [1, 2, 3, 4, 5, PAD, PAD, PAD]]
    assert b["loss_mask"].tolist() == [[False, True, True] + [False] * 5, [False] * 4 + [True] + [False] * 3]
    assert b["valid_lengths"].tolist() == [3, 5]
    b = collate_chat(samples, pad_id=PAD, max_length=16, static_shapes=True, pad_multiple=4)
    assert b["input_ids"].shape == (2, 16)


def test_bad_config(tok, tmp_path):
    with pytest.raises(ValueError, match=r"data\.source: .*does not exist"):
        _build(tok, str(tmp_path / "nope.jsonl"))
    empty = _write(tmp_path / "e.jsonl", [])
    with pytest.raises(ValueError, match=r"data\.source: .*has no rows"):
        _build(tok, empty)
    src = _write(tmp_path / "d.jsonl", [_conv(i) for i in range(3)])
    with pytest.raises(ValueError, match=r"data\.chat_template: unknown chat template 'qwen'"):
        _build(tok, src, chat_template="qwen")
    with pytest.raises(ValueError, match=r"data\.chat_template: .*'llama3' needs special token"):
        _build(tok, src, chat_template="llama3")  # the Qwen3 tokenizer has no Llama-3 headers
    with pytest.raises(ValueError, match=r"data\.source: 1 rows .* DP rank 1 of 2 with none"):
        _build(tok, src, max_rows=1, rank=1, world=2)
    with pytest.raises(ValueError, match=r"data\.max_length"):
        _build(tok, src, max_length=0)

    sd = _build(tok, src, world=2).state_dict()
    with pytest.raises(ValueError, match=r"data: the dataloader state of 2 DP ranks has no entry for dp_rank_1$"):
        _build(tok, src).load_state_dict(sd)
    other = _write(tmp_path / "o.jsonl", [_conv(i) for i in range(5)])
    sd = _build(tok, src, prefetch_factor=0).state_dict()
    with pytest.raises(ValueError, match=r"saved with 3 rows on this DP rank .* now gives 5"):
        _build(tok, other, prefetch_factor=0).load_state_dict(sd)


def _trained_text(batch, tok):
    """Per sample, the decoded text of its trained tokens."""
    pairs = zip(batch["input_ids"], batch["loss_mask"])
    return [tok.decode(ids[mask].tolist()) for ids, mask in pairs]


@pytest.mark.parametrize("thinking, last_only, expected", [
    (True, False, "a0<|im_end|><think>\nr1\n</think>\n\na1<|im_end|>"),
    (False, False, "a0<|im_end|>a1<|im_end|>"),
    (True, True, "<think>\nr1\n</think>\n\na1<|im_end|>"),
    (False, True, "a1<|im_end|>"),
])  # fmt: skip
def test_chat_options_reach_the_samples(tok, tmp_path, thinking, last_only, expected):
    row = {"messages": [
        {"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    ]}  # fmt: skip
    src = _write(tmp_path / "d.jsonl", [row])
    dl = _build(tok, src, bs=1, chat_template="qwen3", enable_thinking=thinking,
                last_turn_only=last_only, system_prompt="Be brief.")  # fmt: skip
    batch = next(dl)
    assert _trained_text(batch, tok) == [expected]
    text = tok.decode(batch["input_ids"][0].tolist())
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nq0")
    assert ("<think>\n\n</think>\n\na1" in text) == (not thinking)


def test_validate_chat_options():
    cfg = JobConfig()
    assert cfg.data.chat_template == "auto" and cfg.data.enable_thinking
    assert not cfg.data.last_turn_only
    for name in ("auto", "chatml", "qwen3", "llama3"):
        cfg.data.chat_template = name
        validate_job_config(cfg)
    cfg.data.chat_template = "qwen"
    with pytest.raises(ConfigError, match=r"chat_template = 'qwen' must be one of auto, chatml, qwen3,"):
        validate_job_config(cfg)
    cfg.data.chat_template = "chatml"
    cfg.data.enable_thinking = False
    assert any("data.enable_thinking" in w for w in validate_job_config(cfg))
    cfg.data.chat_template = "qwen3"
    assert not any("data.enable_thinking" in w for w in validate_job_config(cfg))
