"""EAGLE-3's and DSpark's proposals replayed as CUDA graphs equal the eager ones (tokens identical,
logits within fp32 tolerance) round after round, through a growing reserve that re-captures, and
the eval measures the same τ with graphs on and off, greedy and sampled. Skipped without CUDA.

The eager references are the CPU test's copies of the proposals before the graph-safe rewrite
(tests/unit/decoding/test_proposals_graph_safe.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.dflash2.proposal import DFlashProposer
from models.dspark import DSparkProposer, dspark_flavors
from models.dspark.model import DSparkDraft
from models.eagle3 import Eagle3Draft, Eagle3Proposer, eagle3_flavors
from models.targets.qwen3 import Qwen3Model, qwen3_flavors
from tests.unit.decoding.test_proposals_graph_safe import (
    ReferenceDSpark,
    ReferenceEagle3,
    dspark_draft,
    eagle3_draft,
    run_rounds,
)
from titan_draft.data.chat.prompts import EvalPrompt
from titan_draft.decoding.acceptance import evaluate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
TOL = dict(rtol=1e-4, atol=1e-4)


class Logged:
    """A proposer whose proposals also record their logits (``propose_with_logits`` or ``walk``)."""

    def __init__(self, proposer):
        self.proposer, self.logits = proposer, []

    def __getattr__(self, name):
        return getattr(self.proposer, name)

    def propose(self, last_token: int) -> torch.Tensor:
        p = self.proposer
        if isinstance(p, Eagle3Proposer):
            picks, logits = p.propose_with_logits(last_token)
        else:
            picks, logits, _ = p.walk(last_token)
            picks, logits = torch.tensor(picks), torch.stack(logits)
        self.logits.append(logits.float().cpu())
        return picks


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("threshold", [0.0, 0.2])
@torch.no_grad()
def test_graphed_dspark_equals_eager(kind, threshold):
    d = dspark_draft(kind, seed=3).float().to(DEV)
    graphed = DSparkProposer(d, confidence_threshold=threshold, graphs=True)
    assert graphed.graphs
    eager = DSparkProposer(d, confidence_threshold=threshold, graphs=False)
    ref = ReferenceDSpark(d, stop_below=threshold)
    lengths = []

    def check(last: int) -> None:
        tokens, logits, _, survival = graphed.run_proposal(last, graphed._propose)  # the replayed outputs
        want, want_logits, _ = _full_walk(ref, last)
        assert tokens.tolist() == want
        torch.testing.assert_close(logits, torch.stack(want_logits), **TOL)
        lengths.append(graphed._kept(survival, threshold))

    run_rounds([graphed, eager, ref], d.args.vocab_size, rounds=12, grow=300, check=check)
    assert graphed._graph is not None and graphed._k.shape[3] > 256
    if threshold:
        assert len(set(lengths)) > 1  # the cut after the replay fell at different slots


def _full_walk(ref: ReferenceDSpark, last: int):
    """The reference walk over every slot (no stop), for the logits."""
    stop, ref.stop_below = ref.stop_below, 0.0
    try:
        return ref.walk(last)
    finally:
        ref.stop_below = stop


@torch.no_grad()
def test_graphed_eagle3_equals_eager():
    d = eagle3_draft(seed=2).float().to(DEV)
    graphed = Logged(Eagle3Proposer(d, num_draft_tokens=4, graphs=True))
    assert graphed.graphs
    eager, ref = Logged(Eagle3Proposer(d, num_draft_tokens=4, graphs=False)), Logged(ReferenceEagle3(d, 4))
    run_rounds([graphed, eager, ref], d.args.vocab_size, rounds=12, grow=300)
    assert graphed._graph is not None and graphed._k.shape[2] > 256
    for got, plain, want in zip(graphed.logits, eager.logits, ref.logits, strict=True):
        torch.testing.assert_close(got, want, **TOL)
        torch.testing.assert_close(got, plain, **TOL)


@pytest.mark.parametrize("kind", ["dflash2", "rnn"])
@torch.no_grad()
def test_graphed_commit_equals_the_plain_commit(kind):
    """graph_commit=True: each round's commit replayed from one graph (lengths changing under it,
    a reserve that grows past the first buffers: a new graph) leaves the context the plain eager
    commit leaves, and the proposals over it are the same."""
    from tests.unit.decoding.test_fixed_commit import dflash2_draft

    d = (dflash2_draft("debugmodel") if kind == "dflash2" else dspark_draft(kind, seed=3)).float().to(DEV)
    cls = DFlashProposer if kind == "dflash2" else DSparkProposer
    graphed, plain = cls(d, graphs=True, graph_commit=True), cls(d, graphs=False)
    run_rounds([graphed, plain], d.args.vocab_size, rounds=14, grow=300)
    assert graphed._commit_graph is not None and graphed._k.shape[3] > 256
    n = graphed.length
    assert n == plain.length and int(graphed._len) == n
    torch.testing.assert_close(graphed._k[..., :n, :], plain._k[..., :n, :], **TOL)
    torch.testing.assert_close(graphed._v[..., :n, :], plain._v[..., :n, :], **TOL)


V = 12  # a small vocabulary: random drafts are accepted now and then


def _target() -> Qwen3Model:
    with torch.device(DEV):
        t = Qwen3Model(replace(qwen3_flavors["debugmodel"], vocab_size=V)).eval()
    t.init_weights(seed=4)
    return t.requires_grad_(False)


def _eval_drafts(target):
    torch.manual_seed(0)
    ds = DSparkDraft(replace(dspark_flavors["debugmodel"], vocab_size=V, target_layer_ids=[1, 3],
                             num_target_layers=6, mask_token_id=V - 1, block_size=5)).to(DEV)
    ea = Eagle3Draft(replace(eagle3_flavors["debugmodel"], vocab_size=V, draft_vocab_size=V,
                             target_layer_ids=[1, 2, 4], num_target_layers=6, ttt_steps=4)).to(DEV)
    for d in (ds, ea):
        d.init_weights()
        with torch.no_grad():
            for p in d.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        d.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    # graphs on: the default (the commit replayed too) and the proposal alone replayed
    return {"dspark": (ds.eval(), lambda d, g: DSparkProposer(d, confidence_threshold=0.1, graphs=g)),
            "dspark_eager_commit": (ds.eval(), lambda d, g: DSparkProposer(d, confidence_threshold=0.1, graphs=g,
                                                                            graph_commit=False)),
            "eagle3": (ea.eval(), lambda d, g: Eagle3Proposer(d, graphs=g))}


@pytest.mark.parametrize("draft", ["dspark", "dspark_eager_commit", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.no_grad()
def test_eval_tau_is_the_same_with_graphs_on_and_off(draft, temperature):
    target = _target()
    model, build = _eval_drafts(target)[draft]
    g = torch.Generator().manual_seed(1)
    prompts = [EvalPrompt(f"p{i}", torch.randint(0, V - 1, (n,), generator=g).tolist())
               for i, n in enumerate((5, 17, 40))]
    assert build(model, None).graphs  # the default on a CUDA device
    reports = [evaluate(target, build(model, graphs), prompts, max_new_tokens=64, stop_ids=[], device=DEV,
                        temperature=temperature, seed=7).to_json() for graphs in (True, False)]
    on, off = ({"tau": r["summary"]["tau"], "accepted": [p["accepted"] for p in r["prompts"]],
                "proposed": [p["proposed"] for p in r["prompts"]]} for r in reports)
    assert on == off
    assert sum(map(sum, on["accepted"])) > 0  # some drafts were accepted
    if temperature == 0:
        assert reports[0]["summary"]["lossless_prompts"] == len(prompts)
