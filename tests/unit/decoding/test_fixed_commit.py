"""The fixed-width commit of a block-diffusion proposer (``graph_commit=True``: what a CUDA graph
replays, run eagerly here) leaves the draft in the state the plain commit leaves it: the same
context keys and values up to the committed length and the same proposals, round after round,
with rows past the length computed and never seen (float64, tiny random DSpark and DFlash2
drafts). The GPU side is tests/gpu/test_proposals_gpu.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.block_diffusion import decoder
from models.dflash2.model import DFlash2Draft
from models.dflash2.proposal import DFlashProposer
from models.dspark import DSparkProposer
from models.targets.qwen3 import Qwen3Model, qwen3_flavors
from tests.unit.decoding.test_proposals_graph_safe import dspark_draft, no_host_reads, run_rounds
from tests.unit.models.dflash2.test_models_dflash2_proposal import VOCAB, _draft


def dflash2_draft(flavor: str) -> DFlash2Draft:
    """The DFlash2 proposal tests' draft (its convolutions and selector away from their no-op
    inits), over their float64 target."""
    target = Qwen3Model(replace(qwen3_flavors["debugmodel"], vocab_size=VOCAB)).double().eval()
    target.init_weights(seed=11)
    return _draft(target, flavor)


def _pair(kind: str):
    if kind == "dflash2":
        d = dflash2_draft("debugmodel")
        return d, DFlashProposer(d, graph_commit=True), DFlashProposer(d)
    d = dspark_draft(kind)
    return d, DSparkProposer(d, graph_commit=True), DSparkProposer(d)


@pytest.mark.parametrize("kind", ["dflash2", "rnn", "gated"])
def test_fixed_commit_leaves_the_plain_commits_state(kind):
    d, fixed, plain = _pair(kind)
    width = fixed.num_draft_tokens + 1
    commits = []
    real_commit = fixed._commit_fixed

    def counted():
        commits.append(fixed.length)
        real_commit()

    fixed._commit_fixed = counted
    accepted = run_rounds([fixed, plain], d.args.vocab_size, rounds=14, grow=300)
    assert len(set(accepted)) > 2  # commits of 1 .. width tokens
    assert len(commits) == 14  # every round's commit took the fixed path; the prompt and the 300 did not
    assert fixed.length == plain.length and fixed._k.shape[3] > 256
    n = fixed.length
    torch.testing.assert_close(fixed._k[:, :, :, :n], plain._k[:, :, :, :n], rtol=0, atol=1e-12)
    torch.testing.assert_close(fixed._v[:, :, :, :n], plain._v[:, :, :, :n], rtol=0, atol=1e-12)
    assert int(fixed._len) == n
    # rows past the length were written (and are masked): the last commit's spare rows are there
    assert fixed._k[:, :, :, n : n + width].abs().sum() > 0 or accepted[-1] == width - 1


def test_fixed_commit_reads_nothing_on_the_host():
    d, fixed, _ = _pair("rnn")
    run_rounds([fixed], d.args.vocab_size, rounds=2)
    with no_host_reads():
        fixed._commit_fixed()


def test_the_fixed_commit_is_the_default_where_proposals_replay(monkeypatch):
    d, d2 = dspark_draft("rnn"), dflash2_draft("debugmodel")
    # eagerly (the CPU) the plain commit: the fixed width would only add rows
    assert not DSparkProposer(d).graph_commit and not DFlashProposer(d2).graph_commit
    assert DSparkProposer(d, graph_commit=True).graph_commit  # asked for, it is kept
    # where proposals replay as graphs, the commit replays too unless turned off (the GPU timing
    # of 2026-12-05); graphs stubbed on here, no graph is captured by construction
    monkeypatch.setattr(decoder, "maybe_graphs", lambda graphs, device, name: True)
    assert DSparkProposer(d).graph_commit and DFlashProposer(d2).graph_commit
    assert not DSparkProposer(d, graph_commit=False).graph_commit
