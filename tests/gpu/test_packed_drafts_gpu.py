"""On CUDA: the drafts' flex BlockMasks of packed rows, built from per-row document intervals,
equal ``create_block_mask``'s on the device; and each draft under compiled flex attention in
bf16 gives a packed row of documents the per-document losses and the gradients of the same
documents alone (bf16 tolerance). Skipped without CUDA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from models.block_diffusion.layers import make_mask_mod, sample_anchors
from models.block_diffusion.mask import block_diffusion_block_mask
from models.eagle3 import Eagle3Draft
from models.eagle3.block_mask import ttt_block_mask
from models.eagle3.objective import ttt_mask_mod
from titan_draft.protocols import TargetFeatures
from titan_draft.protocols.features import document_spans

from tests.unit.models.test_packing_equivalence import CASES, H, MASK_TOKEN, _build

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
SEQ = 256
LENGTHS = (70, 101, 45)  # then a padding tail of 40; the documents cross the 128 tile edge
OFFSETS = (0, 70, 171)


def _doc_ids(lengths, seq):
    ids = torch.full((seq,), len(lengths), dtype=torch.int32)
    at = 0
    for i, n in enumerate(lengths):
        ids[at : at + n] = i
        at += n
    return ids, at


def _listed(bm) -> list:
    num, idx = bm.kv_num_blocks.flatten(0, -2).cpu(), bm.kv_indices.flatten(0, -3).cpu()
    full_num, full_idx = bm.full_kv_num_blocks.flatten(0, -2).cpu(), bm.full_kv_indices.flatten(0, -3).cpu()
    return [[(set(idx[r, i, : int(num[r, i])].tolist()), set(full_idx[r, i, : int(full_num[r, i])].tolist()))
             for i in range(num.shape[1])] for r in range(num.shape[0])]


@pytest.mark.parametrize("b,n", [(16, 32), (7, 128)])
def test_block_diffusion_block_mask_of_packed_rows_equals_create_block_mask(b, n):
    seq = 512
    rows = [_doc_ids((130, 40, 200, 90), seq), _doc_ids((300, 5, 120), seq)]
    doc_ids = torch.stack([r[0] for r in rows]).to(DEV)
    valid = torch.tensor([r[1] for r in rows], device=DEV)
    loss = torch.rand(2, seq, generator=torch.Generator().manual_seed(0)).to(DEV) > 0.3
    starts, ends = document_spans(doc_ids, valid, seq)
    anchors, keep = sample_anchors(loss, valid, n, True, torch.Generator(device=DEV).manual_seed(1), ends=ends)
    doc_starts = starts.gather(1, anchors)
    mod = make_mask_mod(anchors, keep, seq, b, doc_starts)
    got = block_diffusion_block_mask(anchors, keep, seq, b, mask_mod=mod, doc_starts=doc_starts)
    want = create_block_mask(mod, 2, None, n * b, seq + n * b, device=DEV)
    assert _listed(got) == _listed(want)
    assert torch.equal(got.to_dense(), want.to_dense())


@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_block_mask_of_packed_rows_equals_create_block_mask(step):
    seq = 512
    rows = [_doc_ids((130, 40, 200, 90), seq), _doc_ids((300, 5, 120), seq)]
    doc_ids = torch.stack([r[0] for r in rows]).to(DEV)
    valid = torch.tensor([r[1] for r in rows], device=DEV)
    starts, _ = document_spans(doc_ids, valid, seq)
    mod = ttt_mask_mod(seq, valid, starts)
    got = ttt_block_mask(seq, valid, step, mask_mod=mod, starts=starts)
    want = create_block_mask(mod, 2, None, seq, (step + 1) * seq, device=DEV)
    assert _listed(got) == _listed(want)
    assert torch.equal(got.to_dense(), want.to_dense())


def _documents(n_aux: int):
    g = torch.Generator().manual_seed(3)
    docs = []
    for n in LENGTHS:
        ids = torch.randint(0, 4, (n,), generator=g)
        ids[::3] = torch.randint(4, MASK_TOKEN, (len(ids[::3]),), generator=g)
        loss = torch.ones(n, dtype=torch.bool)
        loss[: n // 3] = False
        docs.append(dict(ids=ids, loss=loss, aux=torch.randn(n, n_aux * H, generator=g),
                         last=torch.randn(n, H, generator=g) * 2))
    return docs


def _row(parts, n_aux: int, seed: int, packed: bool) -> TargetFeatures:
    g = torch.Generator().manual_seed(seed)
    ids, loss = torch.zeros(SEQ, dtype=torch.long), torch.zeros(SEQ, dtype=torch.bool)
    aux, last = torch.randn(SEQ, n_aux * H, generator=g), torch.randn(SEQ, H, generator=g)
    doc_ids = torch.full((SEQ,), len(parts), dtype=torch.int32)
    at = 0
    for i, p in enumerate(parts):
        n = len(p["ids"])
        ids[at : at + n], loss[at : at + n], aux[at : at + n], last[at : at + n] = p["ids"], p["loss"], p["aux"], p["last"]
        doc_ids[at : at + n] = i
        at += n
    t = lambda x: x[None].to(DEV)  # noqa: E731
    bf = lambda x: x[None].to(DEV, torch.bfloat16)  # noqa: E731
    return TargetFeatures(t(ids), t(loss), torch.tensor([at], device=DEV), bf(aux), last_hidden=bf(last),
                          document_ids=t(doc_ids) if packed else None)


def _doc_of(pos):
    return (pos >= OFFSETS[1]).long() + (pos >= OFFSETS[2]).long()


def _step(d, f, anchors=None, keep=None):
    d.zero_grad(set_to_none=True)
    out = d(f) if isinstance(d, Eagle3Draft) else d.forward_with_anchors(f, anchors, keep)
    out.loss_sum.backward()
    return out, {n: p.grad.float().clone() for n, p in d.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("case", list(CASES))
def test_packed_row_equals_each_document_alone_under_flex(case):
    d, n_aux = _build(case)
    eagle = isinstance(d, Eagle3Draft)
    if not eagle:  # N * b = 256 block rows: two 128 tiles
        d.args = replace(d.args, num_anchors=256 // d.args.block_size)
    d.args = replace(d.args, attn_backend="flex")
    d = d.to(DEV, torch.bfloat16)
    docs = _documents(n_aux)
    packed = _row(docs, n_aux, seed=9, packed=True)
    anchors, keep = (None, None) if eagle else d.sample_anchors(packed, torch.Generator(device=DEV).manual_seed(5))
    total, total_grads = _step(d, packed, anchors, keep)
    sums = {}
    for i in range(len(LENGTHS)):
        alone_f = _row([docs[i]], n_aux, seed=10 + i, packed=False)
        if eagle:
            alone, grads = _step(d, alone_f)
            only = torch.zeros_like(packed.loss_mask)
            only[0, OFFSETS[i] : OFFSETS[i] + LENGTHS[i]] = True
            part, _ = _step(d, replace(packed, loss_mask=packed.loss_mask & only))
        else:
            mine = keep[0] & (_doc_of(anchors[0]) == i)
            a = torch.zeros_like(anchors)
            a[0, : int(mine.sum())] = anchors[0][mine] - OFFSETS[i]
            k = torch.arange(anchors.shape[1], device=DEV)[None] < int(mine.sum())
            alone, grads = _step(d, alone_f, a, k)
            part, _ = _step(d, packed, anchors, keep & (_doc_of(anchors) == i))
        assert alone.loss_denominator > 0
        torch.testing.assert_close(part.loss_denominator, alone.loss_denominator, rtol=1e-6, atol=0)
        torch.testing.assert_close(part.loss_sum.float(), alone.loss_sum.float(), rtol=2e-2, atol=1e-2)
        for n, g in grads.items():
            sums[n] = sums.get(n, 0) + g
    assert total_grads.keys() == sums.keys()
    for n, g in sums.items():
        err = (total_grads[n] - g).norm() / g.norm().clamp(min=1e-6)
        assert err < 3e-2, f"{case}: grad {n} off by {float(err):.3g}"
