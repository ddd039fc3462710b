"""DSpark against its definition (arXiv 2607.05147; DeepSpec's training code), piece by piece.

Everything a test compares with comes from tests/dspark_reference.py: plain eager float64 from
the draft's parameters and the target's tensors, one block and one slot at a time, without
calling the draft's forward, heads or loss. Pieces: the backbone (DFlash's block over the target
context), which slot predicts which token, which target position teaches it, the L1 over the
whole vocabulary, the confidence target and input, the weights and the per-term normalization,
and the Markov head teacher-forced in training and fed its own drafts at decoding.

The definition's constants are written there, not read from the args: a flavor or a default
that drifts from them fails ``test_recipe_constants_are_the_definitions``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from dspark_reference import (
    ARGS,
    CE_W,
    CONF_W,
    DECAY,
    L1_W,
    B,
    S,
    make_anchors,
    make_draft,
    make_features,
    ref_block_rows,
    ref_greedy_chain,
    ref_markov_feature,
    reference_step,
)

from models.dspark import DSparkProposer, dspark_flavors
from models.dspark.args import DSparkArgs


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Matrices of a few dozen rows: a second thread only adds synchronization."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- (1) the backbone and the slot convention ---------------------------------------------------

def test_block_rows_are_dflash_blocks_anchored_at_the_anchor():
    """The training block rows equal the definition's block: anchor token in slot 0, masks after,
    positions a .. a + b - 1, context strictly before the anchor, the whole block visible."""
    d = make_draft()
    f = make_features()
    anchors, keep = make_anchors(f)
    assert (anchors[keep] == 0).sum() == 0 and not keep.all()
    hidden, _ = d.block_hidden(f, anchors, keep)
    for bi in range(2):
        for n in range(anchors.shape[1]):
            if keep[bi, n]:
                want = ref_block_rows(d, f.aux_hidden[bi], f.input_ids[bi], int(anchors[bi, n]))
                got = hidden[bi, n * B:(n + 1) * B]
                assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (bi, n)


# ---- (1)-(5) the loss, one term at a time and as the recipe weighs them -----------------------

TERMS = {"ce": (1.0, 0.0, 0.0), "l1": (0.0, 1.0, 0.0), "confidence": (0.0, 0.0, 1.0), "recipe": (CE_W, L1_W, CONF_W),
         "confidence_h_only": (0.0, 0.0, 1.0)}  # the head reading h_k alone


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("term", list(TERMS))
def test_loss_and_gradients_equal_the_definition(term, kind):
    """loss_sum / loss_denominator (what the trainer minimizes: it divides by the all-reduced
    denominator) and its gradient in every parameter equal the definition's, one term alone
    (CE: which token each slot predicts; L1: which target position teaches it, over the whole
    vocabulary; confidence: c* detached, input [h_k; W1[x_{k-1}]]) and the recipe's sum."""
    ce_w, l1_w, conf_w = TERMS[term]
    args = replace(ARGS, markov_head_type=kind, ce_loss_weight=ce_w, l1_loss_weight=l1_w,
                   confidence_loss_weight=conf_w, confidence_head_with_markov=term != "confidence_h_only")
    d = make_draft(args)
    f = make_features()
    anchors, keep = make_anchors(f)
    out = d.forward_with_anchors(f, anchors, keep)
    (out.loss_sum / out.loss_denominator).backward()
    got = {name: p.grad.clone() for name, p in d.named_parameters()}
    d.zero_grad()
    _, wsum, means, _ = reference_step(d, f, anchors, keep)
    want = ce_w * means["ce"] + l1_w * means["l1"] + conf_w * means["bce"]
    want.backward()
    assert out.loss_denominator.item() == pytest.approx(wsum, rel=1e-12)
    assert (out.loss_sum / out.loss_denominator).item() == pytest.approx(want.item(), rel=1e-10)
    for name, p in d.named_parameters():
        assert torch.allclose(got[name], p.grad, rtol=1e-8, atol=1e-12), name
    # every trainable tensor is reached, except the confidence head by a loss without its term and
    # the Markov bias (W2 and the feature's own layers) by the confidence term alone: it reaches
    # that term only through c*, which is detached (W1 still reaches it as the head's input)
    dead = sorted(name for name, g in got.items() if g.abs().max() == 0)
    want_dead = [] if conf_w else ["confidence_head.proj.bias", "confidence_head.proj.weight"]
    if (ce_w, l1_w) == (0.0, 0.0):
        want_dead = sorted(name for name in got if name == "markov_head.markov_w2.weight"
                           or name.startswith(("markov_head.gate_proj.", "markov_head.joint_proj."))
                           or (name == "markov_head.markov_w1.weight" and not args.confidence_head_with_markov))
    assert dead == want_dead
    # and the metrics are the same per-term means
    for metric, ref in (("ce", "ce"), ("l1", "l1"), ("conf_bce", "bce")):
        num, den = out.metrics[metric]
        assert (num / den).item() == pytest.approx(means[ref].item(), rel=1e-10), metric


def test_the_weights_are_exp_decay_times_the_cumulative_mask():
    """Which slots count and how much: weight exp(-k/4) on slot k while slots 0..k all have a
    label inside the sequence that is a loss token; 0 from the first one that has not (a draft
    past a miss is never verified), and on padded anchor slots."""
    d = make_draft()
    f = make_features()
    anchors, keep = make_anchors(f)
    out = d.forward_with_anchors(f, anchors, keep)
    _, wsum, _, slots = reference_step(d, f, anchors, keep)
    counts = [0] * B
    for (bi, n, k) in slots:
        counts[k] += 1
    # the per-slot counts of the eval mask (acc_k's denominator) and the weight sum
    for k in range(B):
        assert float(out.metrics[f"acc_{k}"][1]) == counts[k], k
    assert sum(math.exp(-k / DECAY) * c for k, c in enumerate(counts)) == pytest.approx(wsum, rel=1e-12)
    assert out.loss_denominator.item() == pytest.approx(wsum, rel=1e-12)
    assert counts[0] > counts[-1] > 0  # the mask cuts blocks short, and some blocks run to the end


def test_confidence_target_is_the_acceptance_of_a_sampled_draft():
    """c*_k = 1 - |p_d - p_t|_1 / 2 = sum_v min(p_d, p_t): what the confidence head is fitted to
    (its mean error against it, conf_abs_error) and the probabilistic acceptance metric."""
    d = make_draft()
    f = make_features()
    anchors, keep = make_anchors(f)
    out = d.forward_with_anchors(f, anchors, keep)
    with torch.no_grad():
        _, wsum, _, slots = reference_step(d, f, anchors, keep)
    err = 0.0
    per_slot = [[0.0, 0] for _ in range(B)]
    for (bi, n, k), (p, pt, conf) in slots.items():
        cstar = float(torch.minimum(p, pt).sum())
        err += math.exp(-k / DECAY) * abs(float(conf) - cstar)
        per_slot[k][0] += cstar
        per_slot[k][1] += 1
    num, den = out.metrics["conf_abs_error"]
    assert float(num / den) == pytest.approx(err / wsum, rel=1e-9)
    for k, (total, count) in enumerate(per_slot):
        num, den = out.metrics[f"accept_rate_{k}"]
        assert (float(num), float(den)) == (pytest.approx(total, rel=1e-10), count)


def test_recipe_constants_are_the_definitions():
    """The loss constants of every DSpark flavor and of the bare args are the definition's
    (0.1 / 0.9 / 1.0, decay 4, blocks of 7 drafting 7); the Qwen3-8B flavor is DeepSpec's recipe
    (5 layers, 512 anchors, Markov rank 256, vanilla head, confidence head reading W1)."""
    for name, a in {**dspark_flavors, "DSparkArgs()": DSparkArgs()}.items():
        assert (a.ce_loss_weight, a.l1_loss_weight, a.confidence_loss_weight) == (CE_W, L1_W, CONF_W), name
        assert a.loss_gamma == DECAY, name
        assert a.enable_confidence_head and a.confidence_head_with_markov, name
    for name in ("qwen3_8b", "smollm2", "DSparkArgs()"):
        a = dspark_flavors.get(name) or DSparkArgs()
        assert a.block_size == 7, name
    q = dspark_flavors["qwen3_8b"]
    assert (q.num_layers, q.num_anchors, q.markov_rank, q.markov_head_type) == (5, 512, 256, "vanilla")


# ---- (6) the Markov head at decoding --------------------------------------------------------

@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_decoding_chains_the_drafted_tokens_from_the_anchor(kind):
    """At decoding the Markov head reads the token drafted in the previous slot (not the data's,
    which decoding does not have), the chain starting from the anchor; greedy: each slot's pick
    is the argmax of lm_head(h_k) + W2 f_k. The drafts differ from a chain fed the data's tokens
    (the check tells the two apart)."""
    d = make_draft(replace(ARGS, markov_head_type=kind), markov_scale=1.5).eval()
    f = make_features()
    x, aux = f.input_ids[0], f.aux_hidden[0]
    prop = DSparkProposer(d)
    differs = False
    for anchor in (3, 6, 9):
        prop.reset(S + B + 1)
        prop.commit(x[:anchor], aux[:anchor])
        got = prop.propose(int(x[anchor])).tolist()
        with torch.no_grad():
            rows = ref_block_rows(d, aux, x, anchor)
            want = ref_greedy_chain(d, rows, int(x[anchor]), None)
            forced = ref_greedy_chain(d, rows, int(x[anchor]), x[anchor + 1:].tolist())
        assert got == want, anchor
        differs |= forced != want
    assert differs


def test_sampled_decoding_chains_the_sampled_tokens():
    """At T = 1 a proposal samples slot by slot and returns the draft distributions it sampled
    from: row k is softmax(lm_head(h_k) + W2 f(d_{k-1})) with d_{-1} the anchor and d_{k-1} the
    token it sampled (not the argmax), and over draws the tokens are not always the greedy ones."""
    d = make_draft().eval()
    f = make_features()
    x, aux = f.input_ids[0], f.aux_hidden[0]
    anchor = 6
    prop = DSparkProposer(d)
    prop.set_sampling(1.0, torch.Generator().manual_seed(0))
    lm, w2 = d.target_lm_head, d.markov_head.markov_w2.weight
    rows = ref_block_rows(d, aux, x, anchor).detach()
    greedy = None
    sampled_other = False
    for _ in range(20):
        prop.reset(S + B + 1)
        prop.commit(x[:anchor], aux[:anchor])
        tokens = prop.propose(int(x[anchor]))
        probs = prop.draft_probs
        prev = int(x[anchor])
        for k, tok in enumerate(tokens.tolist()):
            feat, _, _ = ref_markov_feature(d, rows[k], prev, None)
            assert torch.allclose(probs[k].double(), torch.softmax(lm @ rows[k] + w2 @ feat, 0).detach())
            prev = tok
        if greedy is None:
            greedy = DSparkProposer(d)
            greedy.reset(S + B + 1)
            greedy.commit(x[:anchor], aux[:anchor])
            greedy = greedy.propose(int(x[anchor])).tolist()
        sampled_other |= tokens.tolist() != greedy
    assert sampled_other
