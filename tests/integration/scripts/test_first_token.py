"""scripts/first_token.py on real exports of all three drafts: the first draft it reads after each
prefix is the one the speculative sampling loop draws its first token from after that prefix
(the rounds the loop ran, compared by their q), and the figures it writes are the means of the
per-position terms it writes, bucketed by the target's top-1 probability."""

from __future__ import annotations

import json
import statistics

import pytest
import torch
from helpers import debug_job_argv, run_training

from scripts import first_token
from titan_draft.checkpoint.draft_source import load_draft_source
from titan_draft.decoding.evaluator import build_eval_draft
from titan_draft.decoding.first_token import forced_first_tokens
from titan_draft.decoding.sampling import speculative_sample
from titan_draft.eval import build_proposer
from titan_draft.features.target import load_target, write_random_target


class Recording:
    """A proposer as it is, recording each proposal's first q by how many tokens were committed."""

    def __init__(self, inner):
        self.inner, self.committed, self.q = inner, 0, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def reset(self, max_len):
        self.committed = 0
        self.inner.reset(max_len)

    def commit(self, token_ids, aux, last_hidden):
        self.committed += token_ids.numel()
        self.inner.commit(token_ids, aux, last_hidden)

    def propose(self, last_token):
        out = self.inner.propose(last_token)
        self.q[self.committed] = self.inner.draft_probs[0].clone()
        return out


@pytest.fixture(scope="module")
def exports(tmp_path_factory, chat_jsonl, random_target_dir) -> dict[str, str]:
    out = {}
    for name in ("eagle3", "dflash2", "dspark"):
        dump = tmp_path_factory.mktemp(f"first_token_{name}")
        run_training(debug_job_argv(name, dump, random_target_dir, chat_jsonl, "--training.steps", "2",
                                    "--data.max_rows", "0", "--training.local_batch_size", "2", max_length=64))
        out[name] = str(dump / "export")
    return out


@pytest.mark.parametrize("name", ["eagle3", "dflash2", "dspark"])
def test_the_first_draft_is_the_one_the_loop_draws_from(name, exports, random_target_dir):
    device = torch.device("cpu")
    target = load_target(random_target_dir, dtype=torch.float32, device=device)
    spec, args, state, _ = load_draft_source(exports[name], None)
    draft = build_eval_draft(spec, args, state, target, device, torch.float32)
    prompt = [5, 17, 42, 7, 99, 3]
    loop = Recording(build_proposer(spec, draft, {}))
    gen = speculative_sample(target, loop, prompt, 24, [], device, temperature=1.0,
                             generator=torch.Generator().manual_seed(0))
    forced = Recording(build_proposer(spec, draft, {}))
    out = forced_first_tokens(target, forced, prompt, gen.tokens, device, temperature=1.0,
                              generator=torch.Generator().manual_seed(1))
    assert len(out.accept) == len(gen.tokens) - 1 == 23
    assert sorted(forced.q) == [len(prompt) + j for j in range(23)]
    assert gen.rounds > 3 and set(loop.q) <= set(forced.q)  # a round after every prefix the loop drafted from
    for committed, q in loop.q.items():
        torch.testing.assert_close(forced.q[committed], q, atol=1e-5, rtol=1e-4)


def test_the_script_summarizes_its_own_terms(tmp_path, exports, random_target_dir, capsys):
    out = tmp_path / "first.json"
    result = first_token.main(["--target", random_target_dir, "--draft", exports["eagle3"], "--prompts", "mtbench",
                               "--num-prompts", "2", "--max-new-tokens", "10", "--contexts", "0,1.5",
                               "--device", "cpu", "--proposer-option", "num_draft_tokens=1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["contexts"]) == {"0", "1.5"}
    greedy_tokens = [d["tokens"] for d in result["decodes"]["0"]]
    assert greedy_tokens != [d["tokens"] for d in result["decodes"]["1.5"]]  # sampled decodes are other contexts
    for c, s in result["contexts"].items():
        decodes = result["decodes"][c]
        accept = [x for d in decodes for x in d["accept"]]
        top1 = [x for d in decodes for x in d["target_top1"]]
        assert s["positions"] == len(accept) == sum(len(d["tokens"]) - 1 for d in decodes)
        assert s["accept"] == pytest.approx(statistics.fmean(accept))
        assert sum(b["positions"] for b in s["buckets"]) == len(accept)
        for b in s["buckets"]:
            lo, hi = b["target_top1"]
            rows = [i for i, x in enumerate(top1) if lo <= x < hi or x == hi == 1.0]
            assert b["positions"] == len(rows)
            if rows:
                assert b["accept"] == pytest.approx(statistics.fmean(accept[i] for i in rows))
    assert "| T=0 |" in capsys.readouterr().out


def test_bad_arguments_are_refused_in_one_line(random_target_dir, tmp_path):
    with pytest.raises(SystemExit, match="--temperature must be > 0"):
        first_token.main(["--target", random_target_dir, "--draft", str(tmp_path), "--temperature", "0"])
    with pytest.raises(SystemExit, match="first_token: error: --contexts must be >= 0"):
        first_token.main(["--target", random_target_dir, "--draft", str(tmp_path), "--contexts", "0,-1"])
    with pytest.raises(SystemExit, match="first_token: error: --contexts 'a': expected numbers"):
        first_token.main(["--target", random_target_dir, "--draft", str(tmp_path), "--contexts", "a"])
    with pytest.raises(SystemExit, match="first_token: error: --draft"):
        first_token.main(["--target", random_target_dir, "--draft", str(tmp_path)])


def test_a_target_the_export_was_not_trained_for_is_refused(exports, random_target_dir, tmp_path):
    """The export records its target's frozen tables: another random target of the same shape is
    refused in one line (as the eval refuses it), and read with --allow-target-mismatch."""
    other = write_random_target(str(tmp_path / "other"), seed=123)
    args = ["--target", other, "--draft", exports["eagle3"], "--device", "cpu", "--num-prompts", "1",
            "--max-new-tokens", "3", "--contexts", "0", "--proposer-option", "num_draft_tokens=1"]
    with pytest.raises(SystemExit) as e:
        first_token.main(args)
    assert str(e.value).startswith(f"first_token: error: --target: {other} is not the target "
                                   f"{exports['eagle3']} was trained for: frozen tables") and "\n" not in str(e.value)
    assert first_token.main([*args, "--allow-target-mismatch"])["contexts"]["0"]["positions"] > 0
