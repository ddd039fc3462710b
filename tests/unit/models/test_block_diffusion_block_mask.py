"""The analytic block-diffusion BlockMask (models/block_diffusion/mask.py) against flex's own
create_block_mask on the dense grid: the same tiles in the same classes on both the kv side
(forward, dq) and the q side (dk / dv), the mask a block-sparse kernel would apply from those
tables, the same attention outputs (also against dense sdpa), the fallback, and the real
draft's loss under flex.

CPU eager flex_attention evaluates the mask_mod on the whole score matrix and ignores the tile
tables, and to_dense() merges partial and full tiles, so only the table checks can see a
misclassified tile."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import models.block_diffusion.draft as block_draft
import models.block_diffusion.mask as block_mask
from models.common import dense_mask_from_mask_mod
from models.block_diffusion.layers import make_mask_mod, sample_anchors
from models.block_diffusion.mask import block_diffusion_block_mask
from models.dflash2 import DFlash2Draft, dflash2_flavors
from titan_draft.protocols.features import TargetFeatures


def _anchors(pattern: str, bsz: int, seq: int, n: int, seed: int):
    """``(anchors, keep)`` from the real sample_anchors under a loss-mask pattern (``all``: every
    position a candidate), or, for ``boundary``, by hand on tile edges."""
    g = torch.Generator().manual_seed(seed)
    loss = torch.ones(bsz, seq, dtype=torch.bool)
    valid = torch.full((bsz,), seq)
    static = True
    if pattern == "few":  # r candidates in row r >= 1: keep has False slots there
        for r in range(1, bsz):
            loss[r] = False
            loss[r, 3 * r : 4 * r + 1] = True
    elif pattern == "dynamic":  # static False: N = the largest candidate count (row 0's)
        static = False
        loss[1:] = torch.rand(bsz - 1, seq, generator=g) > 0.9
    elif pattern == "near0":
        loss[:, min(n + 2, seq):] = False
    elif pattern == "nearS":
        loss[:, : max(seq - n - 3, 0)] = False
    elif pattern == "short":  # valid length r + 1 in row r >= 1: r candidates, anchors near 0
        valid = torch.tensor([seq] + [1 + r for r in range(1, bsz)])
    elif pattern == "boundary":
        return _boundary_anchors(bsz, seq, n)
    anchors, keep = sample_anchors(loss, valid, n, static, g)
    assert anchors.shape == (bsz, n)
    return anchors, keep


def _boundary_anchors(bsz: int, seq: int, n: int):
    """Anchors on, just before and just after the edges of tiles 16 / 32 / 128 (0 included),
    dealt round-robin to the rows; unused slots last. Row 0 also drops its second block but
    leaves a stale anchor near S in it: keep alone must hide the context (and the rules may
    not assume the anchors' order)."""
    edges = sorted({e + d for t in (16, 32, 128) for e in range(0, seq, t) for d in (-1, 0, 1)} & set(range(seq - 1)))
    anchors = torch.zeros(bsz, n, dtype=torch.long)
    keep = torch.zeros(bsz, n, dtype=torch.bool)
    for r in range(bsz):
        picked = edges[r::bsz][:n]
        anchors[r, : len(picked)] = torch.tensor(picked)
        keep[r, : len(picked)] = True
    keep[0, 1] = False
    anchors[0, 1] = seq - 2
    return anchors, keep


# (S, b, N, T, B): b 16 / 7 / 4 at T 128 and small T, b >= T (full block-key tiles).
SHAPES = [
    (256, 16, 8, 128, 2),
    (256, 7, 128, 128, 2),
    (256, 4, 32, 128, 3),
    (64, 16, 4, 32, 3),
    (64, 7, 16, 16, 2),
    (96, 7, 32, 32, 3),
    (64, 4, 8, 16, 2),
    (48, 32, 3, 16, 3),
    (64, 16, 3, 16, 2),
]
PATTERNS = ["all", "few", "dynamic", "near0", "nearS", "short", "boundary"]
CASES = [(*shape, p) for shape in SHAPES for p in PATTERNS]
CASE_IDS = [f"S{s}-b{b}-N{n}-T{t}-B{bs}-{p}" for s, b, n, t, bs, p in CASES]


def _masks(anchors, keep, seq, b, tile):
    mod = make_mask_mod(anchors, keep, seq, b)
    q_len = anchors.shape[1] * b
    got = block_diffusion_block_mask(anchors, keep, seq, b, mask_mod=mod, tile=tile)
    want = create_block_mask(mod, anchors.shape[0], None, q_len, seq + q_len, device="cpu", BLOCK_SIZE=tile)
    dense = dense_mask_from_mask_mod(mod, anchors.shape[0], q_len, seq + q_len, "cpu")
    return got, want, dense


def _listed(num: torch.Tensor, idx: torch.Tensor) -> list:
    """Per row of tiles, the set of listed tile indices (the order inside a row is not part of
    the mask's meaning)."""
    num, idx = num.flatten(0, -2), idx.flatten(0, -3)
    return [[set(idx[r, i, : int(num[r, i])].tolist()) for i in range(num.shape[1])] for r in range(num.shape[0])]


def _assert_same_tables(got, want):
    assert got.shape == want.shape and got.seq_lengths == want.seq_lengths
    assert got.BLOCK_SIZE == want.BLOCK_SIZE
    assert torch.equal(got.to_dense(), want.to_dense())
    for side in ("kv", "q"):
        for kind in ("", "full_"):
            num, idx = f"{kind}{side}_num_blocks", f"{kind}{side}_indices"
            assert torch.equal(getattr(got, num), getattr(want, num)), num
            assert _listed(getattr(got, num), getattr(got, idx)) == _listed(getattr(want, num), getattr(want, idx)), idx


def _grid(num: torch.Tensor, idx: torch.Tensor, cols: int) -> torch.Tensor:
    """Listed tiles as a bool ``[..., rows, cols]`` grid."""
    on = (torch.arange(idx.shape[-1]) < num[..., None]).long()
    return torch.zeros(*idx.shape[:-1], cols, dtype=torch.long).scatter_add(-1, idx.long(), on) > 0


def _kernel_view(bm, dense: torch.Tensor, q_side: bool) -> torch.Tensor:
    """The ``[B, 1, Q, KV]`` mask a block-sparse kernel applies from the kv-side (forward, dq) or
    q-side (dk / dv) tables: full tiles whole, partial tiles through the mask_mod, else nothing."""
    tq, tk = bm.BLOCK_SIZE
    q_len, kv_len = dense.shape[-2:]
    nq, nk = -(-q_len // tq), -(-kv_len // tk)
    side = "q" if q_side else "kv"
    cols = nq if q_side else nk
    part = _grid(getattr(bm, f"{side}_num_blocks"), getattr(bm, f"{side}_indices"), cols)
    full = _grid(getattr(bm, f"full_{side}_num_blocks"), getattr(bm, f"full_{side}_indices"), cols)
    assert not (part & full).any()
    if q_side:
        part, full = part.transpose(-2, -1), full.transpose(-2, -1)
    assert part.shape[-2:] == (nq, nk)

    def cover(t):
        return t.repeat_interleave(tq, -2).repeat_interleave(tk, -1)[..., :q_len, :kv_len]

    return cover(full) | (cover(part) & dense)


@pytest.mark.parametrize("seq,b,n,tile,bsz,pattern", CASES, ids=CASE_IDS)
def test_tables_equal_create_block_mask(seq, b, n, tile, bsz, pattern):
    anchors, keep = _anchors(pattern, bsz, seq, n, seed=seq * 31 + b * 7 + n)
    if pattern in ("few", "short", "dynamic", "boundary"):
        assert not keep.all()  # the pattern does exercise padded slots
    got, want, dense = _masks(anchors, keep, seq, b, tile)
    _assert_same_tables(got, want)
    for q_side in (False, True):
        assert torch.equal(_kernel_view(got, dense, q_side), dense)


def test_every_tile_class_occurs():
    """The shapes above do meet every class of both kinds of key tile (so the comparison is not
    vacuous): full and partial context tiles, partial block tiles, full ones for b >= T."""
    seen = {"ctx_full": False, "ctx_partial": False, "blk_full": False, "blk_partial": False}
    for seq, b, n, tile, bsz, pattern in CASES:
        anchors, keep = _anchors(pattern, bsz, seq, n, seed=seq * 31 + b * 7 + n)
        partial, full = block_mask.block_diffusion_tile_classes(anchors, keep, seq, b, tile)
        nc = seq // tile
        seen["ctx_full"] |= bool(full[..., :nc].any())
        seen["ctx_partial"] |= bool(partial[..., :nc].any())
        seen["blk_full"] |= bool(full[..., nc:].any())
        seen["blk_partial"] |= bool(partial[..., nc:].any())
    assert all(seen.values()), seen


def test_tile_classes_by_hand():
    # S 32, T 16, b 8, N 4 (Q 32): query tile 0 = blocks 0, 1 (anchors 17, 30), tile 1 = blocks
    # 2 (anchor 31), 3 (dropped: sees no context). Key tiles 0, 1: context; 2, 3: block rows.
    anchors, keep = torch.tensor([[17, 30, 31, 0]]), torch.tensor([[True, True, True, False]])
    got = block_diffusion_block_mask(anchors, keep, 32, 8, mask_mod=make_mask_mod(anchors, keep, 32, 8), tile=16)
    assert _listed(got.full_kv_num_blocks, got.full_kv_indices)[0] == [{0}, set()]
    assert _listed(got.kv_num_blocks, got.kv_indices)[0] == [{1, 2}, {0, 1, 3}]
    # b 32 >= T 16: both query tiles lie in block 0, so both block-key tiles are full.
    anchors, keep = torch.tensor([[5]]), torch.tensor([[True]])
    got = block_diffusion_block_mask(anchors, keep, 16, 32, mask_mod=make_mask_mod(anchors, keep, 16, 32), tile=16)
    assert _listed(got.full_kv_num_blocks, got.full_kv_indices)[0] == [{1, 2}, {1, 2}]
    assert _listed(got.kv_num_blocks, got.kv_indices)[0] == [{0}, {0}]
    # b 7, T 16: block 2 (rows 14..20) straddles the query tiles 0 and 1, so tile 0 meets block
    # key tiles 0 and 1 (key tile index 2 + j), partially.
    anchors, keep = torch.arange(0, 32, 2)[None], torch.ones(1, 16, dtype=torch.bool)
    partial, full = block_mask.block_diffusion_tile_classes(anchors, keep, 32, 7, 16)
    assert not full[..., 2:].any()
    assert partial[0, 0, 0, 2:5].tolist() == [True, True, False]
    assert partial[0, 0, 1, 2:5].tolist() == [True, True, True]


@pytest.mark.parametrize("seq,b,n,tile", [(64, 7, 16, 16), (64, 32, 2, 16)])
def test_flex_outputs_equal_the_reference_and_sdpa(seq, b, n, tile):
    bsz, heads, dim = 2, 2, 8
    anchors, keep = _anchors("few", bsz, seq, n, seed=5)
    got_bm, want_bm, dense = _masks(anchors, keep, seq, b, tile)
    g = torch.Generator().manual_seed(seq + b)
    q_len, kv_len = n * b, seq + n * b
    q = torch.randn(bsz, heads, q_len, dim, generator=g, dtype=torch.float64)
    k = torch.randn(bsz, heads, kv_len, dim, generator=g, dtype=torch.float64)
    v = torch.randn(bsz, heads, kv_len, dim, generator=g, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = flex_attention(q, k, v, block_mask=got_bm)
        ref = flex_attention(q, k, v, block_mask=want_bm)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(got, sdpa, rtol=1e-10, atol=1e-10)


# S not a multiple of T, Q not a multiple of T (N * b = 5 * 7), T 1.
@pytest.mark.parametrize("seq,b,n,tile", [(40, 4, 8, 16), (64, 7, 5, 16), (12, 3, 4, 1)])
def test_fallback_is_create_block_mask(seq, b, n, tile, monkeypatch):
    anchors, keep = _anchors("few", 2, seq, n, seed=3)
    calls = []

    def spy(*a, **k):
        calls.append(k.get("BLOCK_SIZE"))
        return create_block_mask(*a, **k)

    monkeypatch.setattr(block_mask, "create_block_mask", spy)
    got, want, dense = _masks(anchors, keep, seq, b, tile)
    assert calls == [tile]
    _assert_same_tables(got, want)
    for name in ("kv_indices", "full_kv_indices", "q_indices", "full_q_indices"):
        assert torch.equal(getattr(got, name), getattr(want, name))
    with pytest.raises(ValueError):
        block_mask.block_diffusion_tile_classes(anchors, keep, seq, b, tile)


V, H = 24, 32
ARGS = replace(dflash2_flavors["debugmodel"], vocab_size=V, hidden_size=H, intermediate_size=48, num_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, block_size=4, num_anchors=32,
               loss_gamma=3.0, mask_token_id=V - 1, target_layer_ids=[0, 2], num_target_layers=4,
               conv_kernel_size=2, conv_group_size=8, selector_rank=6, selector_top_k=2, ce_chunk_rows=37,
               attn_backend="sdpa")


def test_dflash2_loss_under_flex_uses_it_and_equals_sdpa(monkeypatch):
    """S 128 and N * b = 128: one 128 tile each way, so the draft takes the analytic path (the
    fallback would call create_block_mask, which is made to fail), and its float64 forward
    loss under flex equals the dense sdpa one."""
    bsz, seq = 2, 128
    torch.manual_seed(0)
    model = DFlash2Draft(ARGS).double()
    model.init_weights()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():  # away from init's no-op conv / selector
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (0.2 if "norm" in name else 0.1))
    model.load_frozen_tables(torch.randn(V, H, generator=g, dtype=torch.float64),
                             torch.randn(V, H, generator=g, dtype=torch.float64))
    ids = torch.randint(0, V - 1, (bsz, seq), generator=g)
    loss = torch.rand(bsz, seq, generator=g) > 0.2
    loss[1, 40:] = False  # few candidates in row 1: padded anchor slots
    f = TargetFeatures(ids, loss, torch.tensor([seq, 100]),
                       torch.randn(bsz, seq, 2 * H, generator=g, dtype=torch.float64))
    anchors, keep = sample_anchors(f.loss_mask, f.valid_lengths, ARGS.num_anchors, True, g)
    assert not keep.all()
    calls = []

    def spy(*a, **k):
        calls.append(a[2:4])
        return block_diffusion_block_mask(*a, **k)

    def no_dense(*a, **k):
        raise AssertionError("create_block_mask was called")

    monkeypatch.setattr(block_draft, "block_diffusion_block_mask", spy)
    monkeypatch.setattr(block_mask, "create_block_mask", no_dense)
    with torch.no_grad():
        sdpa = model.forward_with_anchors(f, anchors, keep)
        assert calls == []
        model.args = replace(ARGS, attn_backend="flex")
        flex = model.forward_with_anchors(f, anchors, keep)
    assert calls == [(seq, ARGS.block_size)]
    torch.testing.assert_close(flex.loss_sum, sdpa.loss_sum, rtol=1e-10, atol=1e-10)
    assert torch.equal(flex.loss_denominator, sdpa.loss_denominator)
    for name, (num, den) in sdpa.metrics.items():
        torch.testing.assert_close(flex.metrics[name][0], num, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(flex.metrics[name][1], den, rtol=1e-10, atol=1e-10)
