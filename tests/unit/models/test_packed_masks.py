"""The drafts' masks over packed rows: the flex tile tables built from per-row document intervals
equal ``create_block_mask``'s (and a brute-force classification of the mask) on random packed
rows; the dense CPU mask is the mask_mod evaluated point by point and the documents rule written
out by hand; shapes the tile rules do not cover are refused; anchors are drawn only where the
next token is in the same document, uniformly over those candidates."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from models.block_diffusion.layers import make_mask_mod, sample_anchors
from models.block_diffusion.mask import block_diffusion_block_mask, block_diffusion_tile_classes
from models.common import dense_mask_from_mask_mod
from models.common.document_mask import interval_tiles
from models.eagle3.block_mask import ttt_block_mask, ttt_tile_classes
from models.eagle3.objective import ttt_mask_mod
from titan_draft.protocols.features import document_spans


def _packed_rows(bsz: int, seq: int, seed: int):
    """``(document_ids [B, S] int32, valid_lengths [B], loss_mask [B, S])``: random documents
    back to back (lengths 1 .. S / 2; row 0 starts with one of 3 S / 4), then a padding tail (sometimes none); one document in
    three has no loss token."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(bsz, seq, dtype=torch.int32)
    loss = torch.rand(bsz, seq, generator=g) > 0.2
    valid = torch.empty(bsz, dtype=torch.long)
    for r in range(bsz):
        at, d = 0, 0
        fill = seq if r == 0 else int(torch.randint(seq // 2, seq + 1, (1,), generator=g))
        while at < fill:
            n = min(int(torch.randint(1, seq // 2 + 1, (1,), generator=g)), fill - at)
            if r == 0 and d == 0:
                n = 3 * seq // 4  # a long first document: full tiles of keys
            ids[r, at : at + n] = d
            if d % 3 == 2:
                loss[r, at : at + n] = False
            at, d = at + n, d + 1
        ids[r, at:] = d
        loss[r, at:] = False
        valid[r] = at
    return ids, valid, loss


def _classes(dense: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force: ``(partial, full)`` tile grids of a dense ``[B, 1, Q, KV]`` mask."""
    bsz, _, q, kv = dense.shape
    t = dense.view(bsz, 1, q // tile, tile, kv // tile, tile).transpose(3, 4).flatten(-2)
    full = t.all(-1)
    return t.any(-1) & ~full, full


def _listed(bm) -> dict:
    out = {}
    for side in ("kv", "q"):
        for kind in ("", "full_"):
            num, idx = getattr(bm, f"{kind}{side}_num_blocks"), getattr(bm, f"{kind}{side}_indices")
            num, idx = num.flatten(0, -2), idx.flatten(0, -3)
            out[kind + side] = [[set(idx[r, i, : int(num[r, i])].tolist()) for i in range(num.shape[1])]
                                for r in range(num.shape[0])]
    return out


def test_interval_tiles_equal_brute_force():
    g = torch.Generator().manual_seed(0)
    bsz, q_len, tile, kv_tiles = 3, 64, 8, 6
    lo = torch.randint(0, kv_tiles * tile, (bsz, q_len), generator=g)
    hi = lo + torch.randint(-5, 30, (bsz, q_len), generator=g)  # some empty intervals
    lo[0, :8], hi[0, :8] = 8, 16  # one tile of rows seeing exactly one key tile: full
    kv = torch.arange(kv_tiles * tile)
    dense = ((kv >= lo[:, :, None]) & (kv < hi[:, :, None]))[:, None]
    partial, full = interval_tiles(lo, hi, tile, kv_tiles)
    want_partial, want_full = _classes(dense, tile)
    assert torch.equal(full, want_full) and full.any()
    assert torch.equal(partial, want_partial) and partial.any()


# (S, block size, anchors, tile): b dividing the tile, b 7 straddling tiles, b >= tile
BLOCK_SHAPES = [(64, 4, 16, 16), (96, 7, 32, 32), (64, 16, 4, 16), (128, 7, 64, 32), (64, 32, 2, 16)]


@pytest.mark.parametrize("seq,b,n,tile", BLOCK_SHAPES)
def test_block_diffusion_tables_of_packed_rows(seq, b, n, tile):
    doc_ids, valid, loss = _packed_rows(3, seq, seed=seq + b)
    starts, ends = document_spans(doc_ids, valid, seq)
    anchors, keep = sample_anchors(loss, valid, n, True, torch.Generator().manual_seed(1), ends=ends)
    keep[0, -1] = False  # a dropped block with a stale anchor: keep alone hides its context
    assert keep.any()
    doc_starts = starts.gather(1, anchors)
    mod = make_mask_mod(anchors, keep, seq, b, doc_starts)
    q_len = n * b
    dense = dense_mask_from_mask_mod(mod, 3, q_len, seq + q_len, "cpu")
    partial, full = block_diffusion_tile_classes(anchors, keep, seq, b, tile, doc_starts)
    want_partial, want_full = _classes(dense, tile)
    assert torch.equal(partial, want_partial) and torch.equal(full, want_full)
    got = block_diffusion_block_mask(anchors, keep, seq, b, mask_mod=mod, tile=tile, doc_starts=doc_starts)
    want = create_block_mask(mod, 3, None, q_len, seq + q_len, device="cpu", BLOCK_SIZE=tile)
    assert _listed(got) == _listed(want)
    assert torch.equal(got.to_dense(), want.to_dense())
    # the document rule does cut tiles here: without it the context tiles would differ
    plain = block_diffusion_tile_classes(anchors, keep, seq, b, tile)
    assert not (torch.equal(plain[0], partial) and torch.equal(plain[1], full))


@pytest.mark.parametrize("seq,tile", [(64, 16), (96, 32), (128, 16)])
@pytest.mark.parametrize("step", [0, 2])
def test_ttt_tables_of_packed_rows(seq, tile, step):
    doc_ids, valid, _ = _packed_rows(3, seq, seed=seq + tile)
    starts, _ = document_spans(doc_ids, valid, seq)
    mod = ttt_mask_mod(seq, valid, starts)
    kv_len = (step + 1) * seq
    dense = dense_mask_from_mask_mod(mod, 3, seq, kv_len, "cpu")
    partial, full = ttt_tile_classes(seq, valid, step, tile, starts)
    want_partial, want_full = _classes(dense, tile)
    assert torch.equal(partial, want_partial) and torch.equal(full, want_full) and full.any()
    got = ttt_block_mask(seq, valid, step, mask_mod=mod, block_size=tile, starts=starts)
    want = create_block_mask(mod, 3, None, seq, kv_len, device="cpu", BLOCK_SIZE=tile)
    assert _listed(got) == _listed(want)
    assert torch.equal(got.to_dense(), want.to_dense())


def _pointwise(mod, bsz: int, q_len: int, kv_len: int) -> torch.Tensor:
    out = torch.zeros(bsz, q_len, kv_len, dtype=torch.bool)
    h = torch.tensor(0)
    for b in range(bsz):
        for q in range(q_len):
            for kv in range(kv_len):
                out[b, q, kv] = bool(mod(torch.tensor(b), h, torch.tensor(q), torch.tensor(kv)))
    return out


def test_dense_masks_are_the_mask_mods_point_by_point_and_the_documents_rule():
    seq, b, n, step = 24, 3, 5, 1
    doc_ids, valid, loss = _packed_rows(2, seq, seed=7)
    starts, ends = document_spans(doc_ids, valid, seq)
    docs = doc_ids.tolist()
    anchors, keep = sample_anchors(loss, valid, n, True, torch.Generator().manual_seed(2), ends=ends)
    mod = make_mask_mod(anchors, keep, seq, b, starts.gather(1, anchors))
    dense = dense_mask_from_mask_mod(mod, 2, n * b, seq + n * b, "cpu")[:, 0]
    assert torch.equal(dense, _pointwise(mod, 2, n * b, seq + n * b))
    rule = torch.zeros_like(dense)
    for r in range(2):
        for q in range(n * b):
            a, k = int(anchors[r, q // b]), bool(keep[r, q // b])
            for kv in range(seq):  # a kept block: the context of its anchor's document before it
                rule[r, q, kv] = k and kv < a and docs[r][kv] == docs[r][a]
            for j in range(n * b):
                rule[r, q, seq + j] = j // b == q // b
    assert torch.equal(dense, rule)

    mod = ttt_mask_mod(seq, valid, starts)
    dense = dense_mask_from_mask_mod(mod, 2, seq, (step + 1) * seq, "cpu")[:, 0]
    assert torch.equal(dense, _pointwise(mod, 2, seq, (step + 1) * seq))
    rule = torch.zeros_like(dense)
    for r in range(2):
        for t in range(seq):
            for s in range(seq):  # step 0: causal inside the document (the padding tail is one)
                rule[r, t, s] = s <= t and docs[r][s] == docs[r][t]
            rule[r, t, seq + t] = True
    assert torch.equal(dense, rule)


def test_packed_shapes_outside_the_tile_rules_are_refused():
    doc_ids, valid, loss = _packed_rows(1, 96, seed=1)
    starts, ends = document_spans(doc_ids, valid, 96)
    anchors, keep = sample_anchors(loss, valid, 8, True, torch.Generator().manual_seed(0), ends=ends)
    doc_starts = starts.gather(1, anchors)
    mod = make_mask_mod(anchors, keep, 96, 4, doc_starts)
    with pytest.raises(ValueError, match="data.max_length to be a multiple of the 128-position tile, got 96"):
        block_diffusion_block_mask(anchors, keep, 96, 4, mask_mod=mod, doc_starts=doc_starts)
    with pytest.raises(ValueError, match="num_anchors \\* block_size to be a multiple of the 32-position tile, got 40"):
        block_diffusion_block_mask(anchors[:, :5], keep[:, :5], 96, 8, tile=32, doc_starts=doc_starts[:, :5],
                                   mask_mod=make_mask_mod(anchors[:, :5], keep[:, :5], 96, 8, doc_starts[:, :5]))
    with pytest.raises(ValueError, match="data.max_length to be a multiple of the 128-position tile, got 96"):
        ttt_block_mask(96, valid, 1, mask_mod=ttt_mask_mod(96, valid, starts), starts=starts)


def test_anchors_of_packed_rows_stay_inside_documents_uniformly():
    seq = 64
    doc_ids, valid, loss = _packed_rows(2, seq, seed=11)
    starts, ends = document_spans(doc_ids, valid, seq)
    cand = torch.zeros(2, seq, dtype=torch.bool)
    for r in range(2):
        for t in range(seq - 1):
            cand[r, t] = bool(loss[r, t] and loss[r, t + 1]) and doc_ids[r, t] == doc_ids[r, t + 1] and t + 1 < valid[r]
    assert (cand.sum(1) >= 8).all()
    # more slots than candidates: exactly the candidates, sorted, the rest padded
    anchors, keep = sample_anchors(loss, valid, seq, True, torch.Generator().manual_seed(0), ends=ends)
    for r in range(2):
        assert anchors[r][keep[r]].tolist() == cand[r].nonzero().flatten().tolist()
    # fewer slots: uniform over the candidates (so over documents by their candidates), and the
    # same generator state draws the same anchors (resume stays exact)
    n, draws = 6, 300
    gen = torch.Generator().manual_seed(1)
    hits = torch.zeros(2, seq)
    for _ in range(draws):
        anchors, keep = sample_anchors(loss, valid, n, True, gen, ends=ends)
        assert keep.all() and cand.gather(1, anchors).all()
        hits.scatter_add_(1, anchors, torch.ones(2, n))
    expected = n * draws / cand.sum(1, keepdim=True)
    assert torch.equal(hits > 0, cand)
    assert ((hits[cand] / expected.expand(2, seq)[cand]) - 1).abs().max() < 0.45
    again = sample_anchors(loss, valid, n, True, torch.Generator().manual_seed(3), ends=ends)
    assert all(torch.equal(x, y) for x, y in
               zip(again, sample_anchors(loss, valid, n, True, torch.Generator().manual_seed(3), ends=ends), strict=True))
