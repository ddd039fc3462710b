"""EAGLE-3's diagonal TTT attention (``ttt_attention = "diagonal"``, models/eagle3/ttt_attention.py)
against the concat form it replaces, which test_models_eagle3.py checks against a float64 loop:
the same loss and gradients in float64 (padded and packed rows, ttt_steps 1 to 5), flex's forward
equal to the dense form's, and one traced graph for every step after the first."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.common import attention, attention_with_lse, build_attention_mask
from models.eagle3 import Eagle3Draft, eagle3_flavors
from models.eagle3.objective import ttt_mask_mod
from models.eagle3.ttt_attention import build_diagonal_past, diagonal_attention, diagonal_slots
from titan_draft.protocols import TargetFeatures

V, VD, H = 97, 40, 32


def _draft(ttt_attention: str, ttt_steps: int, attn_backend="sdpa", dtype=torch.float64) -> Eagle3Draft:
    args = replace(eagle3_flavors["debugmodel"], vocab_size=V, draft_vocab_size=VD, hidden_size=H, intermediate_size=48,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, ttt_steps=ttt_steps,
                   target_layer_ids=[1, 2, 4], num_target_layers=6, ttt_attention=ttt_attention,
                   attn_backend=attn_backend)
    torch.manual_seed(0)
    d = Eagle3Draft(args).to(dtype)
    d.init_weights()
    with torch.no_grad():
        for p in d.parameters():  # larger than init, so the attention weights are far from uniform
            p.normal_(0.0, 0.3)
        d.d2t.copy_(torch.tensor(sorted(torch.randperm(V)[:VD].tolist())) - torch.arange(VD))
        d.t2d.zero_()
        d.t2d[d.draft_ids()] = True
    g = torch.Generator().manual_seed(1)
    d.load_frozen_tables(torch.randn(V, H, generator=g, dtype=dtype), torch.randn(V, H, generator=g, dtype=dtype))
    return d


def _features(packed: bool, seq=20, dtype=torch.float64) -> TargetFeatures:
    g = torch.Generator().manual_seed(2)
    docs = torch.tensor([[0] * 7 + [1] * 5 + [2] * 6 + [3] * 2, [0] * 11 + [1] * 6 + [2] * 3], dtype=torch.int32)
    return TargetFeatures(input_ids=torch.randint(0, V, (2, seq), generator=g),
                          loss_mask=torch.rand(2, seq, generator=g) > 0.3,
                          valid_lengths=torch.tensor([18, 17]) if packed else torch.tensor([seq, seq - 6]),
                          aux_hidden=torch.randn(2, seq, 3 * H, generator=g, dtype=dtype),
                          last_hidden=torch.randn(2, seq, H, generator=g, dtype=dtype) * 2,
                          document_ids=docs if packed else None)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("ttt_steps", [1, 2, 3, 5])
def test_diagonal_loss_and_gradients_equal_the_concat_form(packed, ttt_steps):
    f = _features(packed)
    outs, grads = [], []
    for form in ("concat", "diagonal"):
        d = _draft(form, ttt_steps)
        out = d(f)
        outs.append(out)
        grads.append(dict(zip([n for n, p in d.named_parameters() if p.requires_grad],
                              torch.autograd.grad(out.loss_sum, [p for p in d.parameters() if p.requires_grad]))))
    concat, diagonal = outs
    assert concat.loss_sum.item() > 0
    torch.testing.assert_close(diagonal.loss_sum, concat.loss_sum, rtol=1e-12, atol=1e-12)
    for key, (num, den) in concat.metrics.items():
        torch.testing.assert_close(diagonal.metrics[key][0], num, rtol=1e-12, atol=1e-12, msg=key)
        assert torch.equal(diagonal.metrics[key][1], den), key
    for name, want in grads[0].items():
        torch.testing.assert_close(grads[1][name], want, rtol=1e-10, atol=1e-12, msg=name)


def test_diagonal_attention_equals_attention_under_the_ttt_mask():
    """Step i's attention alone, against sdpa over the concatenated keys under objective.py's
    mask, with unused slots holding garbage (they must weigh nothing)."""
    g = torch.Generator().manual_seed(3)
    b, h, hkv, s, dh, steps = 2, 4, 2, 12, 8, 6
    lengths = torch.tensor([12, 9])
    mask_mod = ttt_mask_mod(s, lengths)
    q = torch.randn(b, h, s, dh, generator=g, dtype=torch.float64) * 2
    kvs = [(torch.randn(b, hkv, s, dh, generator=g, dtype=torch.float64) * 2,
            torch.randn(b, hkv, s, dh, generator=g, dtype=torch.float64)) for _ in range(steps)]
    mask0 = build_attention_mask(mask_mod, b, s, s, "cpu", "sdpa")
    for i in range(1, steps):
        past = build_diagonal_past(kvs[:i], diagonal_slots(steps))
        past = past._replace(k=torch.where(past.used[:, None], past.k, 1e3), v=torch.where(past.used[:, None], past.v, 1e3))
        got = diagonal_attention(q, *kvs[i], past, mask0)
        keys = torch.cat([k for k, _ in kvs[: i + 1]], dim=2)
        values = torch.cat([v for _, v in kvs[: i + 1]], dim=2)
        want = attention(q, keys, values, build_attention_mask(mask_mod, b, s, (i + 1) * s, "cpu", "sdpa"))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"step {i}")
    with pytest.raises(ValueError, match="do not fit"):
        build_diagonal_past(kvs, 2)


def test_flex_log_sum_exp_equals_the_dense_form():
    """attention_with_lse through flex (forward, CPU) and through the dense path: outputs and
    log-sum-exps agree, GQA included; a row with no key has a weight that vanishes when merged."""
    g = torch.Generator().manual_seed(4)
    b, h, hkv, s, dh = 2, 4, 2, 128, 16
    lengths = torch.tensor([128, 77])
    q = torch.randn(b, h, s, dh, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, s, dh, generator=g, dtype=torch.float64) for _ in range(2))
    mask_mod = ttt_mask_mod(s, lengths)
    o_f, lse_f = attention_with_lse(q, k, v, build_attention_mask(mask_mod, b, s, s, "cpu", "flex"))
    o_d, lse_d = attention_with_lse(q, k, v, build_attention_mask(mask_mod, b, s, s, "cpu", "sdpa"))
    torch.testing.assert_close(o_f, o_d, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse_f, lse_d, rtol=1e-10, atol=1e-10)
    empty = torch.zeros(b, 1, s, s, dtype=torch.bool)
    o, lse = attention_with_lse(q.requires_grad_(True), k, v, empty)
    weight = torch.softmax(torch.stack([lse, torch.zeros_like(lse)], -1), -1)[..., 0]
    assert weight.max() == 0 and torch.isfinite(o).all()
    (weight[..., None] * o).sum().backward()
    assert torch.isfinite(q.grad).all()


def test_flex_forward_of_the_diagonal_form_equals_the_dense_one():
    """The whole TTT loss with flex's step-0 BlockMask (forward only on CPU) against sdpa's concat form."""
    g = torch.Generator().manual_seed(5)
    seq = 128
    f = TargetFeatures(input_ids=torch.randint(0, V, (2, seq), generator=g),
                       loss_mask=torch.rand(2, seq, generator=g) > 0.3, valid_lengths=torch.tensor([128, 90]),
                       aux_hidden=torch.randn(2, seq, 3 * H, generator=g, dtype=torch.float64),
                       last_hidden=torch.randn(2, seq, H, generator=g, dtype=torch.float64) * 2)
    with torch.no_grad():
        got = _draft("diagonal", 4, attn_backend="flex")(f).loss_sum
        want = _draft("concat", 4, attn_backend="sdpa")(f).loss_sum
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_every_step_after_the_first_reuses_one_graph():
    """The layer compiled as the trainer compiles it (in place): the concat form traces a graph
    per TTT step, the diagonal form two (step 0, and one for all later steps)."""
    from torch._dynamo.testing import CompileCounter

    f = _features(False)
    traced = {}
    for form in ("concat", "diagonal"):
        torch._dynamo.reset()
        d = _draft(form, 5)
        counter = CompileCounter()
        d.midlayer.compile(backend=counter, dynamic=False)
        with torch._dynamo.config.patch(recompile_limit=8):
            d(f).loss_sum.backward()
        traced[form] = counter.frame_count
    torch._dynamo.reset()
    assert traced == {"concat": 5, "diagonal": 2}
