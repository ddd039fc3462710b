"""Every registered draft on a packed row of documents A, B, C (``TargetFeatures.document_ids``)
computes, in float64, what it computes on A, B, C each alone in its own padded row: the same
per-document loss terms, metric sums and parameter gradients under the same anchors; and
changing document A's tokens and features changes nothing computed for B or C.

The features are built by hand as the target guarantees them: a packed document's captured
features are those of the document alone, so the packed row concatenates the documents' own
random features (then a padding tail of other random values)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.dflash2 import DFlash2Draft, dflash2_flavors
from models.dspark import DSparkDraft, dspark_flavors
from models.eagle3 import Eagle3Draft, eagle3_flavors
from titan_draft.protocols import TargetFeatures

from helpers import registered_drafts

V, H, SEQ = 61, 32, 48
LENGTHS = (11, 17, 9)  # then a padding tail of 11
OFFSETS = (0, 11, 28)
MASK_TOKEN = V - 1
BLOCK = dict(vocab_size=V, hidden_size=H, intermediate_size=48, num_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, mask_token_id=MASK_TOKEN, target_layer_ids=[0, 2],
             num_target_layers=4, ce_chunk_rows=13, attn_backend="sdpa", static_anchors=True)


def _perturbed(d, seed):
    """Away from the init's special values (identity convolutions, zero codebook / W2, unit norms),
    which would hide a convolution or head that mixes documents."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * (0.2 if "norm" in name else 0.1))
    return d


def _dflash2(conv_and_selector: bool):
    args = replace(dflash2_flavors["debugmodel"], **BLOCK, block_size=8, num_anchors=40, loss_gamma=3.0,
                   conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=3, selector_topk_group=0,
                   conv_enabled=conv_and_selector, selector_enabled=conv_and_selector)
    torch.manual_seed(0)
    d = DFlash2Draft(args).double()
    d.init_weights()
    return _perturbed(d, 1)


def _dspark(head: str):
    args = replace(dspark_flavors["debugmodel"], **BLOCK, block_size=4, num_anchors=40, markov_rank=8,
                   markov_head_type=head)
    torch.manual_seed(0)
    d = DSparkDraft(args).double()
    d.init_weights()
    return _perturbed(d, 1)


def _eagle3():
    args = replace(eagle3_flavors["debugmodel"], vocab_size=V, draft_vocab_size=40, hidden_size=H, intermediate_size=48,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=16, ttt_steps=4, target_layer_ids=[0, 1, 2],
                   num_target_layers=4, attn_backend="sdpa")
    torch.manual_seed(0)
    d = Eagle3Draft(args).double()
    d.init_weights()
    with torch.no_grad():
        d.d2t.copy_(torch.tensor(sorted(torch.randperm(V)[:40].tolist())) - torch.arange(40))
        d.t2d.zero_()
        d.t2d[d.draft_ids()] = True
    return _perturbed(d, 1)


# (case, registered draft, builder, capture layers)
CASES = {
    "dflash2": ("dflash2", lambda: _dflash2(True), 2),
    "dflash": ("dflash2", lambda: _dflash2(False), 2),
    "dspark_vanilla": ("dspark", lambda: _dspark("vanilla"), 2),
    "dspark_rnn": ("dspark", lambda: _dspark("rnn"), 2),
    "eagle3": ("eagle3", _eagle3, 3),
}


def test_every_registered_draft_is_covered():
    assert {draft for draft, _, _ in CASES.values()} == set(registered_drafts())


def _build(case: str):
    _, make, n_aux = CASES[case]
    d = make()
    g = torch.Generator().manual_seed(2)
    d.load_frozen_tables(torch.randn(V, H, generator=g, dtype=torch.float64),
                         torch.randn(V, H, generator=g, dtype=torch.float64))
    return d, n_aux


def _documents(n_aux: int, seed: int = 3):
    """Per document: token ids (mostly a few frequent ones, so accuracies are neither 0 nor 1),
    a loss mask whose prompt part is off (and one hole), capture features, final hidden states."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for n in LENGTHS:
        ids = torch.randint(0, 4, (n,), generator=g)
        ids[::3] = torch.randint(4, MASK_TOKEN, (len(ids[::3]),), generator=g)
        loss = torch.ones(n, dtype=torch.bool)
        loss[: n // 3] = False  # the prompt
        loss[n // 3 + 3] = False
        docs.append(dict(ids=ids, loss=loss, aux=torch.randn(n, n_aux * H, generator=g, dtype=torch.float64),
                         last=torch.randn(n, H, generator=g, dtype=torch.float64) * 2))
    return docs


def _row(parts: list[dict], n_aux: int, seed: int, packed: bool) -> TargetFeatures:
    """One row of SEQ positions holding ``parts`` back to back, then padding (pad id 0, the
    target's features of padding are arbitrary: random here)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(SEQ, dtype=torch.long)
    loss = torch.zeros(SEQ, dtype=torch.bool)
    aux = torch.randn(SEQ, n_aux * H, generator=g, dtype=torch.float64)
    last = torch.randn(SEQ, H, generator=g, dtype=torch.float64)
    doc_ids = torch.full((SEQ,), len(parts), dtype=torch.int32)
    at = 0
    for i, p in enumerate(parts):
        n = len(p["ids"])
        ids[at : at + n], loss[at : at + n], aux[at : at + n], last[at : at + n] = p["ids"], p["loss"], p["aux"], p["last"]
        doc_ids[at : at + n] = i
        at += n
    return TargetFeatures(ids[None], loss[None], torch.tensor([at]), aux[None], last_hidden=last[None],
                          document_ids=doc_ids[None] if packed else None)


def _packed_anchors(d, f: TargetFeatures):
    """Every anchor candidate of the packed row (num_anchors exceeds their count: the sampler's
    document rule picks them all, the last ones of each document included), padded slots last."""
    anchors, keep = d.sample_anchors(f, torch.Generator().manual_seed(5))
    assert not keep.all() and keep.sum() >= 12
    return anchors, keep


def _doc_of(pos: torch.Tensor) -> torch.Tensor:
    return (pos >= OFFSETS[1]).long() + (pos >= OFFSETS[2]).long()


def _forward(d, f: TargetFeatures, anchors=None, keep=None):
    d.zero_grad(set_to_none=True)
    out = d(f) if isinstance(d, Eagle3Draft) else d.forward_with_anchors(f, anchors, keep)
    out.loss_sum.backward()
    grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    return out, grads


def _alone(d, docs, i: int, n_aux: int, anchors=None, keep=None):
    """Document ``i`` alone in its row, with the packed row's anchors of it moved to its offset."""
    f = _row([docs[i]], n_aux, seed=10 + i, packed=False)
    if isinstance(d, Eagle3Draft):
        return _forward(d, f)
    mine = keep[0] & (_doc_of(anchors[0]) == i)
    a = (anchors[0][mine] - OFFSETS[i])[None]
    return _forward(d, f, a, torch.ones_like(a, dtype=torch.bool))


def _only(f: TargetFeatures, i: int) -> TargetFeatures:
    """The packed row with the loss mask of document ``i`` only (EAGLE-3's per-document terms:
    the loss mask touches no attention or feature)."""
    keep = torch.zeros_like(f.loss_mask)
    keep[0, OFFSETS[i] : OFFSETS[i] + LENGTHS[i]] = True
    return replace(f, loss_mask=f.loss_mask & keep)


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=what)


def _same_terms(got, want, what):
    _close(got.loss_sum.detach(), want.loss_sum.detach(), f"{what}: loss_sum")
    _close(got.loss_denominator, want.loss_denominator, f"{what}: loss_denominator")
    assert got.metrics.keys() == want.metrics.keys()
    for name, (num, den) in want.metrics.items():
        _close(got.metrics[name][0], num, f"{what}: {name} numerator")
        _close(got.metrics[name][1], den, f"{what}: {name} denominator")


@pytest.mark.parametrize("case", list(CASES))
def test_packed_row_equals_each_document_alone(case):
    d, n_aux = _build(case)
    docs = _documents(n_aux)
    packed = _row(docs, n_aux, seed=9, packed=True)
    eagle = isinstance(d, Eagle3Draft)
    anchors, keep = (None, None) if eagle else _packed_anchors(d, packed)
    total, total_grads = _forward(d, packed, anchors, keep)
    assert total.loss_denominator > 0
    sum_loss, sum_den, sum_grads = 0.0, 0.0, {}
    for i in range(len(LENGTHS)):
        alone, alone_grads = _alone(d, docs, i, n_aux, anchors, keep)
        assert alone.loss_denominator > 0, f"document {i} has no loss term: the test would see nothing"
        if eagle:
            part, part_grads = _forward(d, _only(packed, i))
        else:
            part, part_grads = _forward(d, packed, anchors, keep & (_doc_of(anchors) == i))
        _same_terms(part, alone, f"{case} document {i}")
        assert part_grads.keys() == alone_grads.keys()
        for n in alone_grads:
            _close(part_grads[n], alone_grads[n], f"{case} document {i}: grad {n}")
        sum_loss = sum_loss + alone.loss_sum.detach()
        sum_den = sum_den + alone.loss_denominator
        for n, g in alone_grads.items():
            sum_grads[n] = sum_grads.get(n, 0) + g
    _close(total.loss_sum.detach(), sum_loss, f"{case}: total loss")
    _close(total.loss_denominator, sum_den, f"{case}: total denominator")
    assert total_grads.keys() == sum_grads.keys()
    for n in sum_grads:
        _close(total_grads[n], sum_grads[n], f"{case}: total grad {n}")


def _logits_by_position(d, f: TargetFeatures) -> list[torch.Tensor]:
    """EAGLE-3's draft logits ``[S, Vd]`` of every TTT step."""
    seen = []
    hook = d.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.detach()[0]))
    try:
        with torch.no_grad():
            d(f)
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize("case", list(CASES))
def test_changing_document_a_changes_nothing_for_b_and_c(case):
    d, n_aux = _build(case)
    docs = _documents(n_aux)
    other = _documents(n_aux, seed=4)
    changed = [other[0] | {"loss": docs[0]["loss"]}, docs[1], docs[2]]  # A's tokens and features
    f, f2 = _row(docs, n_aux, seed=9, packed=True), _row(changed, n_aux, seed=9, packed=True)
    a_end = LENGTHS[0]
    if isinstance(d, Eagle3Draft):
        steps, steps2 = _logits_by_position(d, f), _logits_by_position(d, f2)
        for k, (x, y) in enumerate(zip(steps, steps2, strict=True)):
            assert not torch.equal(x[:a_end], y[:a_end])
            assert torch.equal(x[a_end:], y[a_end:]), f"step {k}: B or C's logits moved with A"
        for i in (1, 2):
            with torch.no_grad():
                _same_terms(d(_only(f2, i)), d(_only(f, i)), f"document {i}")
        return
    anchors, keep = _packed_anchors(d, f)
    anchors2, keep2 = _packed_anchors(d, f2)
    in_a = _doc_of(anchors[0]) == 0
    # A's new loss mask is the same, so are the candidates and every anchor of B and C
    assert torch.equal(anchors2[0][~in_a], anchors[0][~in_a]) and torch.equal(keep2, keep)
    b = d.args.block_size
    with torch.no_grad():
        rows, _ = d.block_hidden(f, anchors, keep)
        rows2, _ = d.block_hidden(f2, anchors, keep)
        of_a, of_bc = (in_a & keep[0]).repeat_interleave(b), (~in_a & keep[0]).repeat_interleave(b)
        assert not torch.equal(rows[0, of_a], rows2[0, of_a])
        assert torch.equal(rows[0, of_bc], rows2[0, of_bc]), "the rows of B and C's blocks moved with A"
        for i in (1, 2):
            mine = keep & (_doc_of(anchors) == i)
            _same_terms(d.forward_with_anchors(f2, anchors, mine), d.forward_with_anchors(f, anchors, mine),
                        f"document {i}")


@pytest.mark.parametrize("case", ["dflash2", "dspark_vanilla", "eagle3"])
def test_rope_positions_restart_at_each_document(case):
    """RoPE is relative, so absolute positions inside isolated documents would give the same
    float64 numbers as above: the positions themselves are checked here (what a served draft,
    starting each conversation at 0, rotates by)."""
    d, n_aux = _build(case)
    f = _row(_documents(n_aux), n_aux, seed=9, packed=True)
    own = torch.cat([torch.arange(n) for n in (*LENGTHS, SEQ - sum(LENGTHS))])  # the tail restarts too
    seen = []
    rope = d.rope
    d.rope = lambda positions, dtype: (seen.append(positions[0].clone()), rope(positions, dtype))[1]
    with torch.no_grad():
        if isinstance(d, Eagle3Draft):
            d(f)
            assert [p.tolist() for p in seen] == [(own + i).tolist() for i in range(d.args.ttt_steps)]
            return
        anchors, keep = _packed_anchors(d, f)
        d.forward_with_anchors(f, anchors, keep)
    start = torch.tensor([0, *OFFSETS[1:]])[_doc_of(anchors[0])]
    block = ((anchors[0] - start)[:, None] + torch.arange(d.args.block_size)).flatten()
    kept = keep[0].repeat_interleave(d.args.block_size)
    assert torch.equal(seen[0][kept], block[kept])  # the block queries
    assert torch.equal(seen[1][:SEQ], own) and torch.equal(seen[1][SEQ:][kept], block[kept])  # context, block keys
