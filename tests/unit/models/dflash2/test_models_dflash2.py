"""models/dflash2: loss and metrics against an independent per-block reference, masks,
backends, convolutions, selector, anchors."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask

from models.common import dense_mask_from_mask_mod
from models.dflash2 import DFlash2Draft, dflash2_flavors
from models.block_diffusion.layers import make_mask_mod, sample_anchors
from titan_draft.protocols.features import TargetFeatures

V, H, S, B = 24, 32, 20, 2
ARGS = replace(
    dflash2_flavors["debugmodel"],
    vocab_size=V,
    hidden_size=H,
    intermediate_size=48,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    block_size=4,
    num_anchors=5,
    loss_gamma=3.0,
    mask_token_id=V - 1,
    target_layer_ids=[0, 2],
    num_target_layers=4,
    conv_kernel_size=2,
    conv_group_size=8,
    selector_rank=6,
    selector_top_k=2,
    output_multiplier=1.3,
    final_logit_softcapping=5.0,
    ce_chunk_rows=7,
    attn_backend="sdpa",
)


def _features(dtype=torch.float64) -> TargetFeatures:
    g = torch.Generator().manual_seed(0)
    # mostly tokens {0, 1, 2}, which the lm_head favours: accuracies are neither 0 nor 1
    ids = torch.randint(0, 3, (B, S), generator=g)
    ids[:, ::5] = torch.randint(3, V - 1, (B, 4), generator=g)
    loss_mask = torch.ones(B, S, dtype=torch.bool)
    loss_mask[0, :4] = False
    loss_mask[0, 9] = False
    loss_mask[1] = False
    loss_mask[1, 6:11] = True  # few candidates in row 1: padded anchor slots
    valid = torch.tensor([S, 9])
    aux = torch.randn(B, S, 2 * H, generator=g, dtype=dtype)
    return TargetFeatures(ids, loss_mask, valid, aux)


def _model(args=ARGS, dtype=torch.float64, randomize=True, seed=0) -> DFlash2Draft:
    torch.manual_seed(seed)
    m = DFlash2Draft(args).to(dtype)
    m.init_weights()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        if randomize:  # make every part non-trivial (init makes conv/selector no-ops)
            for name, p in m.named_parameters():
                noise = torch.randn(p.shape, generator=g, dtype=dtype)
                p.copy_(
                    1.0 + 0.2 * noise
                    if "norm" in name
                    else (0.3 if "base_kernel" in name else 0.15) * noise
                )
        embed = torch.randn(V, H, generator=g, dtype=dtype)
        lm_head = torch.randn(V, H, generator=g, dtype=dtype)
        lm_head[3:] *= 0.3
    m.load_frozen_tables(embed, lm_head)
    return m


# ---------------- independent float64 reference: one block at a time ----------------


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [L, heads, D]
    d = x.shape[-1]
    inv = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)], dtype=x.dtype)
    ang = pos[:, None].to(x.dtype) * inv
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _conv(x, base, delta, group):  # x [b, H], base [taps, H], delta [b, taps, H/G]; one block
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for tau in range(base.shape[0]):
            if tau <= r:
                out[r] = out[r] + (base[tau] + delta[r, tau].repeat_interleave(group)) * x[r - tau]
    return out


def _attn(P, pre, a, x, ctx, pos, ctx_pos):
    hd, nh, nkv = a.head_dim, a.num_attention_heads, a.num_key_value_heads
    q = (x @ P[pre + "q_proj.weight"].t()).view(-1, nh, hd)
    kin = torch.cat([ctx, x])
    k = (kin @ P[pre + "k_proj.weight"].t()).view(-1, nkv, hd)
    v = (kin @ P[pre + "v_proj.weight"].t()).view(-1, nkv, hd)
    q = _rope(_rms(q, P[pre + "q_norm.weight"], a.rms_norm_eps), pos, a.rope_theta)
    k = _rope(
        _rms(k, P[pre + "k_norm.weight"], a.rms_norm_eps), torch.cat([ctx_pos, pos]), a.rope_theta
    )
    heads = []
    for h in range(nh):  # the block sees context < anchor and its whole own block
        kv = h // (nh // nkv)
        heads.append(torch.softmax(q[:, h] @ k[:, kv].t() / math.sqrt(hd), -1) @ v[:, kv])
    return torch.cat(heads, -1) @ P[pre + "o_proj.weight"].t()


def _block_hidden_ref(P, a, embed, ids, ctx, anchor):
    b = a.block_size
    x = embed[torch.tensor([ids[anchor].item()] + [a.mask_token_id] * (b - 1))]
    pos = anchor + torch.arange(b)
    c, c_pos = ctx[:anchor], torch.arange(anchor)
    for i in range(a.num_layers):
        pre = f"layers.{i}."
        taps, g = a.conv_kernel_size, a.conv_group_size
        for sub, norm, conv in (
            ("attn", "input_layernorm", "attention_conv"),
            ("mlp", "post_attention_layernorm", "mlp_conv"),
        ):
            n = _rms(x, P[pre + norm + ".weight"], a.rms_norm_eps)
            if a.conv_enabled:
                d = (n @ P[pre + conv + ".kernel_projection.weight"].t()).view(b, 2, taps, H // g)
                n = _conv(n, P[pre + conv + ".base_kernel"][0], d[:, 0], g)
            if sub == "attn":
                y = _attn(P, pre + "self_attn.", a, n, c, pos, c_pos)
            else:
                y = F.silu(n @ P[pre + "mlp.gate_proj.weight"].t()) * (
                    n @ P[pre + "mlp.up_proj.weight"].t()
                )
                y = y @ P[pre + "mlp.down_proj.weight"].t()
            if a.conv_enabled:
                y = _conv(y, P[pre + conv + ".base_kernel"][1], d[:, 1], g)
            x = x + y
    return _rms(x, P["norm.weight"], a.rms_norm_eps)


def _reference(model, f, anchors, keep, alpha):
    a, P = model.args, dict(model.named_parameters())
    embed, lm_head = model.target_embed, model.target_lm_head
    b, K = a.block_size, a.selector_top_k
    z0 = torch.zeros((), dtype=torch.float64)
    loss, acc = z0, {}

    def add(name, num, den):
        n0, d0 = acc.get(name, (z0, z0))
        acc[name] = (n0 + num, d0 + den)

    for i in range(B):
        ctx = _rms(f.aux_hidden[i] @ P["fc.weight"].t(), P["hidden_norm.weight"], a.rms_norm_eps)
        for n in range(anchors.shape[1]):
            add("anchor_fill", float(keep[i, n]), 1.0)  # every anchor slot, trained or not
            if not keep[i, n]:
                continue
            anchor = anchors[i, n].item()
            h = _block_hidden_ref(P, a, embed, f.input_ids[i], ctx, anchor)
            logits = h @ lm_head.t() * a.output_multiplier
            logits = a.final_logit_softcapping * torch.tanh(logits / a.final_logit_softcapping)
            run, run_sel, tau, tau_sel = 1.0, 1.0, 1.0, 1.0
            for k in range(1, b):
                p = anchor + k
                label = f.input_ids[i, min(p, S - 1)].item()
                m = float(p < f.valid_lengths[i].item() and bool(f.loss_mask[i, min(p, S - 1)]))
                w = m * math.exp(-(k - 1) / a.loss_gamma)
                ce = -torch.log_softmax(logits[k], -1)[label]
                if a.soft_labels:  # the target's distribution where it predicted x[p]
                    zt = f.last_hidden[i, min(p - 1, S - 1)] @ lm_head.t() * a.output_multiplier
                    pt = torch.softmax(a.final_logit_softcapping * torch.tanh(zt / a.final_logit_softcapping), -1)
                    ce = -(pt * torch.log_softmax(logits[k], -1)).sum()
                correct = float(logits[k].argmax().item() == label)
                loss = loss + w * ce
                add("ce", w * ce.detach(), w)
                add("acc", m * correct, m)
                add(f"acc_{k}", m * correct, m)
                run *= correct * m
                tau += run
                # selector over the unary top-K with the gold predecessor
                topv, topi = logits[k].topk(K)
                prev = f.input_ids[i, p - 1].item()
                proj = h[k] @ P["candidate_selector.hidden_projection.weight"].t()
                query = P["candidate_selector.predecessor_codebook"][prev] * proj
                scores = torch.stack(
                    [
                        topv[j]
                        + (query * P["candidate_selector.successor_codebook"][topi[j]]).sum()
                        for j in range(K)
                    ]
                )
                hits = (topi == label).nonzero()
                if a.soft_labels:  # the target's distribution over the candidates, by its mass there
                    inside = pt[topi].sum()
                    sel_ce = -(pt[topi] / inside * torch.log_softmax(scores, -1)).sum()
                    loss = loss + alpha * w * inside * sel_ce
                    add("selector_ce", w * inside * sel_ce.detach(), w * inside)
                elif len(hits):
                    sel_ce = -torch.log_softmax(scores, -1)[hits[0, 0]]
                    loss = loss + alpha * w * sel_ce
                    add("selector_ce", w * sel_ce.detach(), w)
                else:
                    add("selector_ce", 0.0, 0.0)
                sel_correct = float(topi[scores.argmax()].item() == label)
                add("selector_acc", m * sel_correct, m)
                add("topk_recall", m * float(len(hits) > 0), m)
                run_sel *= sel_correct * m
                tau_sel += run_sel
            add("accept_len", tau, 1.0)
            add("selector_accept_len", tau_sel, 1.0)
    return loss, acc


def _fit_lm_head(model, f, anchors, keep, scale=3.0):
    """lm_head rows = class means of the draft's hidden states: a nearest-centroid head that is
    right often enough for non-trivial accuracies and acceptance lengths."""
    with torch.no_grad():
        h, blocks = model.block_hidden(f, anchors, keep)
        h = h.view(-1, H)
        labels = blocks.labels.reshape(-1)
        head = model.target_lm_head.clone()
        for c in labels.unique():
            mean = h[labels == c].mean(0)
            head[c] = scale * mean / mean.norm()
    model.load_frozen_tables(model.target_embed, head)


def test_negative_selector_topk_group_is_refused_at_build():
    with pytest.raises(ValueError, match="selector_topk_group must be >= 0"):
        DFlash2Draft(replace(ARGS, selector_topk_group=-1))


@pytest.mark.parametrize("topk_group,soft_labels", [(0, False), (4, False), (4, True)])
def test_loss_metrics_and_grads_match_reference(topk_group, soft_labels):
    # topk_group 4: the selector's candidates from the 2 best of 6 column groups (same values);
    # soft_labels: each slot's CE against the target's distribution from its last_hidden
    model = _model(replace(ARGS, selector_topk_group=topk_group, soft_labels=soft_labels))
    model.selector_alpha = 0.7
    f = _features()
    if soft_labels:
        g = torch.Generator().manual_seed(9)
        f = replace(f, last_hidden=torch.randn(B, S, H, generator=g, dtype=torch.float64))
    anchors, keep = sample_anchors(
        f.loss_mask, f.valid_lengths, ARGS.num_anchors, False, torch.Generator().manual_seed(5)
    )
    _fit_lm_head(model, f, anchors, keep)
    assert keep[0].all() and not keep[1].all()  # row 1 has padded anchor slots
    out = model(f, generator=torch.Generator().manual_seed(5))
    ref_loss, ref_metrics = _reference(model, f, anchors, keep, alpha=0.7)

    torch.testing.assert_close(out.loss_sum, ref_loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(
        out.loss_denominator, torch.as_tensor(ref_metrics["ce"][1], dtype=torch.float64)
    )
    assert set(out.metrics) == set(ref_metrics)
    for name, (num, den) in ref_metrics.items():
        torch.testing.assert_close(
            out.metrics[name][0],
            torch.as_tensor(num, dtype=torch.float64),
            rtol=1e-10,
            atol=1e-10,
            msg=name,
        )
        torch.testing.assert_close(
            out.metrics[name][1],
            torch.as_tensor(den, dtype=torch.float64),
            rtol=1e-10,
            atol=1e-10,
            msg=name,
        )
    # the data make every metric non-trivial
    for name in ("acc", "topk_recall", "selector_acc", "acc_1", "acc_2"):
        num, den = out.metrics[name]
        assert 0 < num < den, name
    assert 0 < out.metrics["selector_ce"][1] < out.metrics["ce"][1]
    for name in ("accept_len", "selector_accept_len"):
        num, den = out.metrics[name]
        assert den < num < ARGS.block_size * den, name

    params = [p for _, p in model.named_parameters()]
    names = [n for n, _ in model.named_parameters()]
    g_model = torch.autograd.grad(out.loss_sum, params)
    g_ref = torch.autograd.grad(ref_loss, params)
    for name, a, r in zip(names, g_model, g_ref):
        torch.testing.assert_close(a, r, rtol=1e-8, atol=1e-10, msg=name)


def test_soft_labels_need_the_targets_last_hidden_and_say_so():
    from models.dflash2.args import reads_last_hidden

    assert not reads_last_hidden(ARGS) and reads_last_hidden(replace(ARGS, soft_labels=True))
    model = _model(replace(ARGS, soft_labels=True))
    with pytest.raises(ValueError, match="soft_labels needs the target's final-norm hidden"):
        model(_features(), generator=torch.Generator().manual_seed(5))


def test_plain_dflash_matches_reference_and_has_no_extras():
    args = replace(
        ARGS,
        conv_enabled=False,
        selector_enabled=False,
        output_multiplier=1.0,
        final_logit_softcapping=0.0,
    )
    model = _model(args)
    f = _features()
    anchors, keep = sample_anchors(
        f.loss_mask, f.valid_lengths, args.num_anchors, False, torch.Generator().manual_seed(2)
    )
    out = model.forward_with_anchors(f, anchors, keep)
    ref_loss, ref_metrics = _reference_plain(model, f, anchors, keep)
    torch.testing.assert_close(out.loss_sum, ref_loss, rtol=1e-10, atol=1e-10)
    assert not any(k.startswith(("selector", "topk")) for k in out.metrics)
    for name in ("ce", "acc", "accept_len"):
        torch.testing.assert_close(
            out.metrics[name][0],
            torch.as_tensor(ref_metrics[name][0], dtype=torch.float64),
            rtol=1e-10,
            atol=1e-10,
        )
    assert not any("conv" in n or "selector" in n for n in model.state_dict())


def _reference_plain(model, f, anchors, keep):
    # reuse the reference with the selector terms weighted 0, keeping only the base metrics
    a = model.args
    P = dict(model.named_parameters())
    P.update(
        {
            "candidate_selector.hidden_projection.weight": torch.zeros(1, H, dtype=torch.float64),
            "candidate_selector.predecessor_codebook": torch.zeros(V, 1, dtype=torch.float64),
            "candidate_selector.successor_codebook": torch.zeros(V, 1, dtype=torch.float64),
        }
    )

    class Shim:
        args = replace(a, selector_top_k=1, output_multiplier=1.0, final_logit_softcapping=1e9)
        target_embed, target_lm_head = model.target_embed, model.target_lm_head

        def named_parameters(self):
            return P.items()

    return _reference(Shim(), f, anchors, keep, alpha=0.0)


def test_dense_mask_equals_loop_reference():
    seq, bs = 7, 3
    anchors = torch.tensor([[0, 2, 5, 0], [1, 3, 0, 0]])
    keep = torch.tensor([[True, True, True, False], [True, True, False, False]])
    mod = make_mask_mod(anchors, keep, seq, bs)
    q_len, kv_len = anchors.shape[1] * bs, seq + anchors.shape[1] * bs
    dense = dense_mask_from_mask_mod(mod, 2, q_len, kv_len, "cpu")
    ref = torch.zeros(2, 1, q_len, kv_len, dtype=torch.bool)
    for b in range(2):
        for q in range(q_len):
            blk = q // bs
            for kv in range(kv_len):
                if kv < seq:
                    ref[b, 0, q, kv] = bool(keep[b, blk]) and kv < anchors[b, blk]
                else:
                    ref[b, 0, q, kv] = (kv - seq) // bs == blk
    assert torch.equal(dense, ref)
    assert torch.equal(create_mask(mod, 2, 1, q_len, kv_len, device="cpu"), ref)


def test_flex_and_sdpa_backends_agree_forward():
    f = _features(torch.float32)
    anchors, keep = sample_anchors(
        f.loss_mask, f.valid_lengths, ARGS.num_anchors, True, torch.Generator().manual_seed(3)
    )
    outs = []
    for backend in ("sdpa", "flex"):
        model = _model(replace(ARGS, attn_backend=backend), dtype=torch.float32)
        with torch.no_grad():
            outs.append(model.block_hidden(f, anchors, keep)[0])
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)
