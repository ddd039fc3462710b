"""DFlash / DFlash2 at decode time: the proposer's block is the training block, its picks follow
the serving rule (argmax; DFlash2's selector walk), and an export reads back into the same draft."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import inverse_cdf

from models.dflash2.args import dflash2_flavors
from models.dflash2.export import dflash2_from_export, export_dflash2
from models.dflash2.model import DFlash2Draft
from models.dflash2.proposal import DFlashProposer
from models.targets.qwen3 import Qwen3Model, qwen3_flavors
from titan_draft.protocols import TargetFeatures

VOCAB, LAYERS = 263, [0, 3, 5]


@pytest.fixture(scope="module")
def target() -> Qwen3Model:
    m = Qwen3Model(replace(qwen3_flavors["debugmodel"], vocab_size=VOCAB)).double().eval()
    m.init_weights(seed=11)
    return m


def _draft(target, flavor: str, **kw) -> DFlash2Draft:
    a = replace(dflash2_flavors[flavor], vocab_size=VOCAB, target_layer_ids=LAYERS, num_target_layers=6,
                mask_token_id=VOCAB - 1, **kw)
    d = DFlash2Draft(a).double()
    torch.manual_seed(1)
    d.init_weights()
    with torch.no_grad():  # away from the no-op inits, so convolutions and selector matter
        for name, p in d.named_parameters():
            if any(s in name for s in ("kernel_projection", "base_kernel", "successor", "norm")):
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    d.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    return d.eval()


def _ids(n: int) -> torch.Tensor:
    return torch.randint(0, VOCAB - 1, (1, n), generator=torch.Generator().manual_seed(n))


@pytest.mark.parametrize("flavor", ["debugmodel", "dflash_debugmodel"])
@torch.no_grad()
def test_decode_block_equals_training_block(target, flavor):
    """The block the proposer runs after committing x_0 .. x_{a-1} is the training block
    anchored at a: same context (strictly before the anchor), positions, mask token."""
    draft = _draft(target, flavor)
    ids = _ids(40)
    aux, _ = target.capture(ids, LAYERS, False)
    feats = TargetFeatures(input_ids=ids, loss_mask=torch.ones_like(ids, dtype=torch.bool),
                           valid_lengths=torch.tensor([40]), aux_hidden=aux)
    proposer = DFlashProposer(draft)
    for a in (1, 9, 23):
        hidden, _ = draft.block_hidden(feats, torch.tensor([[a]]), torch.tensor([[True]]))
        proposer.reset(64)
        half = a // 2  # committed in pieces, as decoding does
        proposer.commit(ids[0, :half], aux[0, :half])
        proposer.commit(ids[0, half:a], aux[0, half:a])
        torch.testing.assert_close(proposer.block_hidden(int(ids[0, a])), hidden[0], rtol=0, atol=1e-12)


def _unary(draft, hidden):
    a = draft.args
    u = a.output_multiplier * (hidden @ draft.target_lm_head.t())
    return a.final_logit_softcapping * torch.tanh(u / a.final_logit_softcapping) if a.final_logit_softcapping else u


def _selector_case(target, **proposer_kw):
    """``(draft, proposer, anchor, block hidden of slots 1.., their unary logits)``: a DFlash2
    draft whose selector codebooks matter, its proposer committed to 16 tokens."""
    draft = _draft(target, "debugmodel")
    sel = draft.candidate_selector
    with torch.no_grad():
        sel.successor_codebook.normal_(0.0, 3.0)
        sel.predecessor_codebook.normal_(0.0, 3.0)
    ids = _ids(17)
    proposer = DFlashProposer(draft, **proposer_kw)
    proposer.commit(ids[0, :16], target.capture(ids[:, :16], LAYERS, False)[0][0])
    anchor = int(ids[0, 16])
    hidden = proposer.block_hidden(anchor)[1:]
    return draft, proposer, anchor, hidden, _unary(draft, hidden)


def _selector_q(draft, hidden, unary, prev: int, temp: float):
    """``(candidates [K], the selector's softmax(scores / T) over them)`` of one slot, from the
    definition: unary top-K value + successor code . (predecessor code * projected hidden)."""
    sel = draft.candidate_selector
    vals, cands = unary.topk(draft.args.selector_top_k)
    query = sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ hidden)
    return cands, torch.softmax((vals + sel.successor_codebook[cands] @ query) / temp, dim=0)


@torch.no_grad()
def test_dflash_proposes_each_slot_argmax(target):
    draft = _draft(target, "dflash_debugmodel", output_multiplier=0.7, final_logit_softcapping=3.0)
    ids = _ids(20)
    proposer = DFlashProposer(draft)
    proposer.commit(ids[0, :19], target.capture(ids[:, :19], LAYERS, False)[0][0])
    hidden = proposer.block_hidden(int(ids[0, 19]))[1:]
    assert proposer.propose(int(ids[0, 19])).tolist() == _unary(draft, hidden).argmax(-1).tolist()


@torch.no_grad()
def test_dflash2_selector_walk(target):
    """Slot k's pick maximizes unary + <A[prev] * P h_k, B[c]> over its unary top-K, prev being
    slot k-1's pick (the anchor for slot 1): checked with plain tensor ops."""
    draft = _draft(target, "debugmodel")
    a, sel = draft.args, draft.candidate_selector
    with torch.no_grad():  # strong enough to overrule the unary argmax
        sel.successor_codebook.normal_(0.0, 3.0)
        sel.predecessor_codebook.normal_(0.0, 3.0)
    ids = _ids(17)
    proposer = DFlashProposer(draft)
    proposer.commit(ids[0, :16], target.capture(ids[:, :16], LAYERS, False)[0][0])
    anchor = int(ids[0, 16])
    hidden = proposer.block_hidden(anchor)[1:]
    unary = _unary(draft, hidden)
    prev, want = anchor, []
    for k in range(a.block_size - 1):
        vals, cands = unary[k].topk(a.selector_top_k)
        query = sel.predecessor_codebook[prev] * (sel.hidden_projection.weight @ hidden[k])
        scores = vals + sel.successor_codebook[cands] @ query
        prev = int(cands[scores.argmax()])
        want.append(prev)
    got = proposer.propose(anchor).tolist()
    assert got == want
    assert got != unary.argmax(-1).tolist()  # the selector changed some picks


@pytest.mark.parametrize("flavor", ["debugmodel", "dflash_debugmodel"])
@torch.no_grad()
def test_export_reads_back_into_the_same_draft(target, flavor):
    draft = _draft(target, flavor)
    info = {"num_hidden_layers": 6, "vocab_size": VOCAB, "hidden_size": 64}
    tensors, config = export_dflash2(draft.state_dict(), draft.args, info)
    args, state = dflash2_from_export(tensors, config)
    names = ["hidden_size", "num_layers", "block_size", "mask_token_id", "target_layer_ids", "conv_enabled",
             "selector_enabled", "rope_theta", "rms_norm_eps", "head_dim", "num_key_value_heads"]
    if draft.args.conv_enabled:
        names += ["conv_kernel_size", "conv_group_size"]
    if draft.args.selector_enabled:
        names += ["selector_rank", "selector_top_k"]
    for name in names:
        assert getattr(args, name) == getattr(draft.args, name), name
    back = DFlash2Draft(args).double()
    back.load_state_dict(state, strict=True)
    back.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    ids = _ids(30)
    aux = target.capture(ids[:, :29], LAYERS, False)[0][0]
    picks = []
    for d in (draft, back.eval()):
        p = DFlashProposer(d)
        p.commit(ids[0, :29], aux)
        picks.append(p.propose(int(ids[0, 29])).tolist())
    assert picks[0] == picks[1]
    with pytest.raises(ValueError, match="not a DFlash draft"):
        dflash2_from_export(tensors, {**config, "architectures": ["LlamaForCausalLMEagle3"]})
    with pytest.raises(ValueError, match="missing field 'block_size'"):
        dflash2_from_export(tensors, {k: v for k, v in config.items() if k != "block_size"})
    with pytest.raises(ValueError, match="missing"):
        dflash2_from_export({k: v for k, v in tensors.items() if k != "norm.weight"}, config)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("flavor", ["debugmodel", "dflash_debugmodel"])
@torch.no_grad()
def test_graphed_proposals_equal_eager_ones(target, flavor):
    """Replayed proposals (one graph, anchors and context lengths changing under it, a reserve
    that grows past the first buffers) equal eager proposals round after round."""
    dev = torch.device("cuda")
    tgt = Qwen3Model(replace(qwen3_flavors["debugmodel"], vocab_size=VOCAB)).to(dev).eval()
    tgt.load_state_dict({k: v.float() for k, v in target.state_dict().items()})
    draft = _draft(target, flavor).float().to(dev)
    draft.load_frozen_tables(tgt.embed_weight(), tgt.lm_head_weight())
    ids = torch.randint(0, VOCAB - 1, (1, 600), generator=torch.Generator().manual_seed(5)).to(dev)
    aux = tgt.capture(ids, LAYERS, False)[0][0]
    eager, graphed = DFlashProposer(draft, graphs=False), DFlashProposer(draft)
    assert graphed.graphs  # the default on a CUDA device
    for p in (eager, graphed):
        p.reset(64)
    pos = 0
    for step in (10, 1, 3, 7, 2, 300, 5):  # the 300 grows the reserve: a new graph
        for p in (eager, graphed):
            p.commit(ids[0, pos : pos + step], aux[pos : pos + step])
        pos += step
        anchor = int(ids[0, pos])
        assert graphed.propose(anchor).tolist() == eager.propose(anchor).tolist()
    assert graphed._graph is not None


def test_graphs_need_a_gpu(target):
    with pytest.raises(ValueError, match="graphs=True needs a CUDA device, the draft is on cpu"):
        DFlashProposer(_draft(target, "debugmodel"), graphs=True)
    assert not DFlashProposer(_draft(target, "debugmodel")).graphs  # the default off a CUDA device


@torch.no_grad()
def test_dflash_samples_each_slot_from_its_own_distribution(target):
    """At T > 0 each slot is drawn independently from softmax(unary / T) with the uniforms of the
    eval's generator, and the proposal hands those distributions to the verify rule."""
    draft = _draft(target, "dflash_debugmodel", output_multiplier=0.7, final_logit_softcapping=3.0)
    ids = _ids(20)
    proposer = DFlashProposer(draft)
    proposer.commit(ids[0, :19], target.capture(ids[:, :19], LAYERS, False)[0][0])
    proposer.set_sampling(1.5, torch.Generator().manual_seed(3))
    got = proposer.propose(int(ids[0, 19])).tolist()
    q = torch.softmax(_unary(draft, proposer.block_hidden(int(ids[0, 19]))[1:]) / 1.5, dim=-1)
    torch.testing.assert_close(proposer.draft_probs, q, rtol=0, atol=1e-12)
    u = torch.rand(draft.args.block_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert got == [inverse_cdf(q[k], float(u[k])) for k in range(len(got))]
    assert got != q.argmax(-1).tolist()  # a draw, not the greedy chain
    proposer.set_sampling(0.0, None)
    assert proposer.propose(int(ids[0, 19])).tolist() == q.argmax(-1).tolist() and proposer.draft_probs is None


@pytest.mark.parametrize("outside", [True, False])
@torch.no_grad()
def test_dflash2_selector_samples_its_chain(target, outside):
    """At T > 0 slot k's draw follows the selector's softmax(scores / T) over its unary top-K,
    the previous slot's DRAWN token as the predecessor. ``outside_candidates`` (the default with a
    selector): q is the unary softmax(z / T) outside the top-K, and on it the unary's mass there
    shared out by the selector's distribution, so a draw can leave the candidates and the chain
    goes on from it; False: q is the selector's distribution on the candidates, zero elsewhere.
    Greedy is the candidates' walk either way."""
    kw = {} if outside else {"outside_candidates": False}  # on by default where there is a selector
    draft, proposer, anchor, hidden, unary = _selector_case(target, **kw)
    assert proposer.outside_candidates == outside
    a, temp = draft.args, 2.0
    differs, left = False, 0
    greedy = _selector_case(target, outside_candidates=False)[1].propose(anchor).tolist()
    for seed in range(8):
        proposer.set_sampling(temp, torch.Generator().manual_seed(seed))
        got = proposer.propose(anchor).tolist()
        u = torch.rand(a.block_size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        prev = anchor
        for k in range(a.block_size - 1):
            cands, qc = _selector_q(draft, hidden[k], unary[k], prev, temp)
            if outside:
                want = torch.softmax(unary[k] / temp, dim=0)
                want[cands] = qc * want[cands].sum()
                pick = inverse_cdf(want, float(u[k]))
            else:
                want = torch.zeros(VOCAB, dtype=torch.float64).scatter(0, cands, qc)
                pick = int(cands[inverse_cdf(qc, float(u[k]))])
            torch.testing.assert_close(proposer.draft_probs[k], want, rtol=0, atol=1e-12)
            assert abs(float(want.sum()) - 1.0) < 1e-12 and got[k] == pick
            left += got[k] not in cands.tolist()
            prev = got[k]
        differs |= got != greedy
    assert differs and (left > 0) == outside  # draws, not the greedy chain; outside the candidates iff asked
    proposer.set_sampling(0.0)
    assert proposer.propose(anchor).tolist() == greedy


def test_outside_candidates_needs_a_selector(target):
    plain = _draft(target, "dflash_debugmodel")
    assert not DFlashProposer(plain).outside_candidates  # nothing to leave: it samples the vocabulary
    with pytest.raises(ValueError, match="^outside_candidates: this draft has no candidate selector"):
        DFlashProposer(plain, outside_candidates=True)
