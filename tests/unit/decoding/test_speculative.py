"""Speculative decoding against a target: the arithmetic of τ on drafts with known behaviour, and
losslessness (the output equals plain greedy decoding) with real DFlash / DFlash2 drafts."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.dflash2.args import dflash2_flavors
from models.dflash2.model import DFlash2Draft
from models.dflash2.proposal import DFlashProposer
from models.targets.qwen3 import Qwen3Model, qwen3_flavors
from titan_draft.decoding.acceptance import evaluate
from titan_draft.decoding.speculative import compare, greedy_decode, speculative_decode
from titan_draft.data.chat.prompts import EvalPrompt
from helpers import GreedyDrafter

CPU = torch.device("cpu")
VOCAB = 257


@pytest.fixture(scope="module")
def target() -> Qwen3Model:
    m = Qwen3Model(replace(qwen3_flavors["debugmodel"], vocab_size=VOCAB)).double().eval()
    m.init_weights(seed=5)
    return m


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class ScriptedProposer(GreedyDrafter):
    """Knows the plain greedy continuation ``truth`` of ``prompt`` and drafts its next tokens,
    the first ``right`` of them correct and the rest deliberately wrong."""

    def __init__(self, prompt, truth, k: int, right: int):
        self.prompt, self.truth, self.right = prompt, truth, right
        self.num_draft_tokens, self.capture_layers, self.needs_last_hidden = k, [1], False
        self.committed: list[int] = []

    def reset(self, max_len):
        self.committed = []

    def commit(self, token_ids, aux, last_hidden):
        assert aux.shape == (len(token_ids), 64)  # the target's layer-1 output of each position
        self.committed += token_ids.tolist()

    def propose(self, last_token):
        n = len(self.committed) - len(self.prompt)  # index of last_token among the new tokens
        assert last_token == self.truth[n]
        nxt = self.truth[n + 1 : n + 1 + self.num_draft_tokens]
        nxt += [0] * (self.num_draft_tokens - len(nxt))
        return torch.tensor([t if i < self.right else (t + 1) % VOCAB for i, t in enumerate(nxt)])


@pytest.mark.parametrize("right,k", [(7, 7), (0, 7), (3, 7), (1, 1)])
def test_tau_of_scripted_drafts(target, right, k):
    """A draft always right reaches τ = block size (k + 1); one always wrong τ = 1; one right
    for its first j tokens τ = j + 1, with acceptance 1 at positions <= j and 0 after."""
    prompt = _prompt(9, 0)
    rounds = 6
    max_new = 1 + rounds * (right + 1)  # the prefill's token, then whole rounds
    truth = greedy_decode(target, prompt, max_new + k + 1, [], CPU).tokens
    proposer = ScriptedProposer(prompt, truth, k, right)
    spec = speculative_decode(target, proposer, prompt, max_new, [], CPU)
    assert spec.tokens == truth[:max_new]
    assert spec.rounds == rounds and spec.accepted == [right] * rounds
    assert spec.round_tokens / spec.rounds == right + 1
    # the draft knows every committed token but the newest, which it was handed as last_token
    assert proposer.committed == prompt + spec.tokens[:-1]
    report = evaluate(target, proposer, [EvalPrompt("p", prompt)], max_new_tokens=max_new, stop_ids=[],
                      device=CPU)
    assert report.tau == right + 1
    assert report.accept_rate() == [1.0] * right + [0.0] * (k - right)
    assert report.lossless == 1 and report.summary()["divergences"] == []


def test_greedy_cache_decodes_each_prompt_plainly_once(target, monkeypatch):
    """With a greedy_cache, the first evaluate decodes each prompt plainly and a second reuses
    those decodes (the training evals' frozen target): the same report, no second plain decode."""
    import titan_draft.decoding.acceptance as acceptance

    calls = []
    real = acceptance.greedy_decode
    monkeypatch.setattr(acceptance, "greedy_decode", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompts = [EvalPrompt("a", _prompt(7, 1)), EvalPrompt("b", _prompt(5, 2))]
    truths = [real(target, p.ids, 20, [], CPU).tokens for p in prompts]
    cache: dict = {}
    reports = []
    for _ in range(2):
        proposers = [ScriptedProposer(p.ids, t, 3, 2) for p, t in zip(prompts, truths)]
        for p, prop in zip(prompts, proposers):
            reports.append(evaluate(target, prop, [p], max_new_tokens=12, stop_ids=[], device=CPU,
                                    greedy_cache=cache if p is prompts[0] else None))
    # prompt a: decoded plainly once over both rounds; prompt b (no cache): every round
    assert len(calls) == 1 + 2 and list(cache) == [(tuple(prompts[0].ids), 12, ())]
    assert [r.summary()["tau"] for r in reports[:2]] == [r.summary()["tau"] for r in reports[2:]]
    assert all(r.lossless == 1 for r in reports)


def test_stop_token_and_max_new_tokens_cut_like_greedy(target):
    prompt = _prompt(7, 1)
    truth = greedy_decode(target, prompt, 40, [], CPU).tokens
    stop = truth[13]
    first = truth.index(stop)
    greedy = greedy_decode(target, prompt, 40, [stop], CPU)
    assert greedy.tokens == truth[: first + 1]
    spec = speculative_decode(target, ScriptedProposer(prompt, truth, 7, 7), prompt, 40, [stop], CPU)
    assert spec.tokens == greedy.tokens
    # tokens past the stop token are dropped and not counted by τ
    assert spec.round_tokens == first and spec.rounds == -(-first // 8)
    for max_new in (1, 5, 8):
        spec = speculative_decode(target, ScriptedProposer(prompt, truth, 7, 7), prompt, max_new, [], CPU)
        assert spec.tokens == truth[:max_new]
    assert speculative_decode(target, ScriptedProposer(prompt, truth, 7, 7), prompt, 0, [], CPU).tokens == []


def _draft(target, flavor: str) -> DFlash2Draft:
    a = replace(dflash2_flavors[flavor], vocab_size=VOCAB, target_layer_ids=[1, 4], num_target_layers=6,
                mask_token_id=VOCAB - 1)
    d = DFlash2Draft(a).double()
    torch.manual_seed(0)
    d.init_weights()
    with torch.no_grad():  # DFlash2's no-op inits (identity conv, zero successor) made non-trivial
        for name, p in d.named_parameters():
            if "kernel_projection" in name or "successor" in name or "base_kernel" in name:
                p.normal_(0.0, 0.3)
    d.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    return d.eval()


@pytest.mark.parametrize("flavor", ["debugmodel", "dflash_debugmodel"])
def test_real_drafts_are_lossless(target, flavor):
    proposer = DFlashProposer(_draft(target, flavor))
    for seed in range(3):
        prompt = _prompt(5 + 4 * seed, 10 + seed)
        greedy = greedy_decode(target, prompt, 48, [], CPU)
        spec = speculative_decode(target, proposer, prompt, 48, [], CPU)
        assert spec.tokens == greedy.tokens
        assert compare(target, prompt, greedy, spec, CPU) is None
        assert all(0 <= m <= n == 7 for m, n in zip(spec.accepted, spec.proposed))


def test_compare_reports_the_first_difference_with_margins(target):
    prompt = _prompt(6, 3)
    greedy = greedy_decode(target, prompt, 10, [], CPU)
    spec = speculative_decode(target, ScriptedProposer(prompt, greedy.tokens + [0] * 9, 7, 7), prompt, 10, [], CPU)
    spec.tokens[4] = (spec.tokens[4] + 1) % VOCAB  # as if a near-tie had flipped
    d = compare(target, prompt, greedy, spec, CPU)
    assert (d.index, d.greedy_token, d.speculative_token) == (4, greedy.tokens[4], spec.tokens[4])
    assert d.margin == pytest.approx(greedy.margins[4])
    logits = target(torch.tensor([prompt + greedy.tokens[:4]]))[0, -1]
    assert d.recomputed_margin == pytest.approx(float(logits[greedy.tokens[4]] - logits[spec.tokens[4]]))
    assert d.recomputed_margin >= d.margin > 0  # top-1 minus top-2 is the smallest gap


class _HostReadsFrom(torch.overrides.TorchFunctionMode):
    """Counts what ``module``'s own lines do that reads the device on the host (or copies from
    the host's memory into it): on a GPU each is a wait for everything queued before it."""

    READS = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "tensor", "cpu", "numpy"}

    def __init__(self, module: str):
        super().__init__()
        self.module, self.calls = module, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import sys

        name = getattr(func, "__name__", "")
        if name in self.READS and sys._getframe(1).f_code.co_filename.endswith(self.module):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("right", [0, 2, 7])
def test_a_greedy_round_reads_the_device_once(target, right):
    """The loop's own work between a proposal and the next reads the device once a round (the
    drafts and the target's choices together), whatever was accepted: the prefill's two reads
    (the prompt in, its token out), then one per round."""
    prompt = _prompt(9, 3)
    truth = greedy_decode(target, prompt, 40, [], CPU).tokens
    proposer = ScriptedProposer(prompt, truth, 7, right)
    with _HostReadsFrom("decoding/speculative.py") as reads:
        spec = speculative_decode(target, proposer, prompt, 30, [], CPU)
    assert spec.tokens == truth[:30] and spec.rounds > 3
    assert len(reads.calls) == 2 + spec.rounds, reads.calls
