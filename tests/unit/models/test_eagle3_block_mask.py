"""The analytic TTT BlockMask (models/eagle3/block_mask.py) against flex's own create_block_mask
evaluated on the dense grid: the same tiles in the same classes (partial / full), the same q-side
tables that backward reads, the mask a block-sparse kernel would apply from those tables, and the
same attention outputs, also against dense-mask sdpa.

CPU eager flex_attention evaluates the mask_mod on the whole score matrix and ignores the tile
tables, so its outputs cannot see a misclassified tile: the table checks are what catch one."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import models.eagle3.objective as objective
from models.common import dense_mask_from_mask_mod
from models.eagle3 import Eagle3Draft, eagle3_flavors
from models.eagle3.block_mask import ttt_block_mask
from models.eagle3.objective import ttt_mask_mod
from titan_draft.protocols import TargetFeatures

STEPS = range(7)
# (seq_len, block_size, valid lengths): full length, inside a tile, on a tile boundary, very short
SHAPES = [
    (256, 128, [256, 200, 128]),
    (384, 128, [1, 384, 129]),
    (384, 128, [255, 5, 256]),
    (64, 16, [64, 1, 16]),
    (64, 16, [40, 5, 63]),
    (96, 32, [96, 33]),
    (96, 32, [32, 1, 95]),
]
SHAPE_IDS = [f"S{s}-bs{bs}-L{'_'.join(map(str, ls))}" for s, bs, ls in SHAPES]


def _reference(seq_len, lengths, step, block_size):
    mask_mod = ttt_mask_mod(seq_len, lengths)
    return create_block_mask(mask_mod, len(lengths), None, seq_len, (step + 1) * seq_len,
                             device="cpu", BLOCK_SIZE=block_size)


def _analytic(seq_len, lengths, step, block_size):
    return ttt_block_mask(seq_len, lengths, step, mask_mod=ttt_mask_mod(seq_len, lengths),
                          block_size=block_size)


def _row_sets(num: torch.Tensor, idx: torch.Tensor) -> list:
    """Each row's listed tiles as a set (their order is not part of the mask's meaning)."""
    num, idx = num.flatten(0, -2), idx.flatten(0, -3)
    return [[set(idx[r, i, : num[r, i]].tolist()) for i in range(num.shape[1])] for r in range(num.shape[0])]


def _assert_same_tiles(got, want):
    assert got.shape == want.shape and got.seq_lengths == want.seq_lengths
    assert got.BLOCK_SIZE == want.BLOCK_SIZE
    assert torch.equal(got.to_dense(), want.to_dense())
    for side in ("kv", "q"):  # kv: forward and dq; q: dk / dv in backward
        for kind in ("", "full_"):
            num, idx = f"{kind}{side}_num_blocks", f"{kind}{side}_indices"
            assert torch.equal(getattr(got, num), getattr(want, num)), num
            assert _row_sets(getattr(got, num), getattr(got, idx)) == \
                _row_sets(getattr(want, num), getattr(want, idx)), idx


def _tiles(num: torch.Tensor, idx: torch.Tensor, cols: int) -> torch.Tensor:
    """The listed tiles of each row as a bool grid ``[..., rows, cols]``."""
    listed = (torch.arange(idx.shape[-1]) < num[..., None]).long()
    return torch.zeros(*idx.shape[:-1], cols, dtype=torch.long).scatter_add(-1, idx.long(), listed) > 0


def _as_a_kernel_applies_it(bm, dense: torch.Tensor, transpose: bool) -> torch.Tensor:
    """What a block-sparse kernel computes from the tables: every element of a full tile, the
    mask_mod's elements of a partial tile, nothing elsewhere. kv side (forward, dq) or, with
    ``transpose``, the q side (dk / dv), brought back to ``[B, 1, Q, KV]``."""
    bq, bkv = bm.BLOCK_SIZE
    q_len, kv_len = dense.shape[-2:]
    nq, nkv = -(-q_len // bq), -(-kv_len // bkv)
    side = "q" if transpose else "kv"
    rows, cols = (nkv, nq) if transpose else (nq, nkv)
    part = _tiles(getattr(bm, f"{side}_num_blocks"), getattr(bm, f"{side}_indices"), cols)
    full = _tiles(getattr(bm, f"full_{side}_num_blocks"), getattr(bm, f"full_{side}_indices"), cols)
    assert part.shape[-2] == rows and not (part & full).any()  # a tile is in one class at most
    if transpose:
        part, full = part.transpose(-2, -1), full.transpose(-2, -1)

    def spread(t):
        return t.repeat_interleave(bq, -2).repeat_interleave(bkv, -1)[..., :q_len, :kv_len]

    return spread(full) | (spread(part) & dense)


@pytest.mark.parametrize("seq_len,block_size,lengths", SHAPES, ids=SHAPE_IDS)
def test_tiles_equal_create_block_mask(seq_len, block_size, lengths):
    lengths = torch.tensor(lengths)
    for step in STEPS:
        got = _analytic(seq_len, lengths, step, block_size)
        _assert_same_tiles(got, _reference(seq_len, lengths, step, block_size))
        dense = dense_mask_from_mask_mod(ttt_mask_mod(seq_len, lengths), len(lengths), seq_len,
                                         (step + 1) * seq_len, "cpu")
        for transpose in (False, True):
            assert torch.equal(_as_a_kernel_applies_it(got, dense, transpose), dense)


def test_tile_classes_by_hand():
    # S 64, tiles of 16 (nb 4), L 40: step-0 tiles 0 and 1 are full below the diagonal, tile 2
    # (keys 32..47) holds L; queries past L still see keys < L. Step 1: diagonal tiles only.
    got = _analytic(64, torch.tensor([40]), 1, 16)
    partial = _row_sets(got.kv_num_blocks, got.kv_indices)[0]
    full = _row_sets(got.full_kv_num_blocks, got.full_kv_indices)[0]
    assert full == [set(), {0}, {0, 1}, {0, 1}]
    assert partial == [{0, 4}, {1, 5}, {2, 6}, {2, 7}]


@pytest.mark.parametrize("seq_len,block_size,lengths", SHAPES[:2] + SHAPES[3:6],
                         ids=SHAPE_IDS[:2] + SHAPE_IDS[3:6])
def test_flex_outputs_equal_the_reference_and_sdpa(seq_len, block_size, lengths):
    g = torch.Generator().manual_seed(seq_len + block_size)
    lengths_t = torch.tensor(lengths)
    bsz, heads, dim = len(lengths), 2, 8
    for step in (0, 1, 6):
        kv_len = (step + 1) * seq_len
        q = torch.randn(bsz, heads, seq_len, dim, generator=g, dtype=torch.float64)
        k = torch.randn(bsz, heads, kv_len, dim, generator=g, dtype=torch.float64)
        v = torch.randn(bsz, heads, kv_len, dim, generator=g, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = flex_attention(q, k, v, block_mask=_analytic(seq_len, lengths_t, step, block_size))
            ref = flex_attention(q, k, v, block_mask=_reference(seq_len, lengths_t, step, block_size))
        dense = dense_mask_from_mask_mod(ttt_mask_mod(seq_len, lengths_t), bsz, seq_len, kv_len, "cpu")
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        torch.testing.assert_close(got, sdpa, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seq_len,block_size", [(100, 16), (9, 128), (200, 128), (32, 1)])
def test_fallback_gives_the_reference_mask(seq_len, block_size):
    lengths = torch.tensor([seq_len, seq_len // 2, 1])
    for step in (0, 2, 6):
        got = _analytic(seq_len, lengths, step, block_size)
        want = _reference(seq_len, lengths, step, block_size)
        _assert_same_tiles(got, want)
        for name in ("kv_indices", "full_kv_indices"):  # the fallback is create_block_mask itself
            assert torch.equal(getattr(got, name), getattr(want, name))


def test_negative_step_is_refused():
    with pytest.raises(ValueError):
        _analytic(64, torch.tensor([64]), -1, 16)


@pytest.mark.parametrize("form,steps_masked", [("concat", [0, 1, 2]), ("diagonal", [0])])
def test_objective_uses_it_under_flex_and_matches_sdpa(monkeypatch, form, steps_masked):
    """The whole TTT loss at S 128 (one 128 tile, so the analytic path) under flex (CPU forward)
    equals the dense sdpa loss, and the masks came from ttt_block_mask: every step's in the concat
    form, step 0's alone in the diagonal form (its later steps reuse it)."""
    vocab, dvocab, hid, seq = 61, 24, 32, 128
    args = replace(eagle3_flavors["debugmodel"], vocab_size=vocab, draft_vocab_size=dvocab, hidden_size=hid,
                   intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8, ttt_steps=3,
                   target_layer_ids=[1, 2, 4], num_target_layers=6, ttt_attention=form)
    torch.manual_seed(0)
    d = Eagle3Draft(args).double()
    d.init_weights()
    with torch.no_grad():
        d.d2t.copy_(torch.tensor(sorted(torch.randperm(vocab)[:dvocab].tolist())) - torch.arange(dvocab))
        d.t2d.zero_()
        d.t2d[d.draft_ids()] = True
    g = torch.Generator().manual_seed(1)
    d.load_frozen_tables(torch.randn(vocab, hid, generator=g, dtype=torch.float64),
                         torch.randn(vocab, hid, generator=g, dtype=torch.float64))
    f = TargetFeatures(input_ids=torch.randint(0, vocab, (2, seq), generator=g),
                       loss_mask=torch.rand(2, seq, generator=g) > 0.3,
                       valid_lengths=torch.tensor([seq, 77]),
                       aux_hidden=torch.randn(2, seq, 3 * hid, generator=g, dtype=torch.float64),
                       last_hidden=torch.randn(2, seq, hid, generator=g, dtype=torch.float64) * 2)
    calls = []

    def spy(*a, **k):
        calls.append(a[2])
        return ttt_block_mask(*a, **k)

    monkeypatch.setattr(objective, "ttt_block_mask", spy)
    with torch.no_grad():
        sdpa = d(f)
        assert calls == []
        d.args = replace(args, attn_backend="flex")
        flex = d(f)
    assert calls == steps_masked
    torch.testing.assert_close(flex.loss_sum, sdpa.loss_sum, rtol=1e-10, atol=1e-10)
    assert flex.loss_denominator == sdpa.loss_denominator
