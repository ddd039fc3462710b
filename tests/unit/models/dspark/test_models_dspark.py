"""DSpark's pieces beyond the definition's (test_models_dspark_definition.py pins each loss term
and its gradient against a reference that also recomputes the backbone): the slot targets on a
hand-written row, the confidence head without its Markov input or off, the metrics, the chunked
distillation and its teacher rows, decoding equal to training, the confidence stop (the init:
test_models_dspark_spec.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from models.block_diffusion.layers import sample_anchors
from models.dspark import DSparkDraft, DSparkProposer, dspark_flavors
from models.dspark.loss import markov_distill, start_teacher_spans, teacher_spans
from models.dspark.objective import build_slot_targets
from titan_draft.protocols import TargetFeatures

V, H, R, S = 61, 32, 8, 14
BASE = replace(dspark_flavors["debugmodel"], vocab_size=V, hidden_size=H, intermediate_size=48,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_layers=2, block_size=4,
               num_anchors=5, markov_rank=R, target_layer_ids=[1, 3], num_target_layers=6, mask_token_id=7,
               ce_chunk_rows=5, loss_gamma=4.0)


def test_slot_convention_and_cumulative_mask():
    """Slot k of the block at a predicts x[a + k + 1] from previous token x[a + k]; the mask is
    cut for good at the first slot whose target is outside the sequence or not a loss token."""
    ids = torch.arange(100, 110)[None]  # x[t] = 100 + t
    loss = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    anchors, keep = torch.tensor([[1, 5, 7, 0]]), torch.tensor([[True, True, True, False]])
    t = build_slot_targets(ids, loss, torch.tensor([9]), anchors, keep, 4, gamma=4.0, dtype=torch.float64)
    assert t.labels[0, 0].tolist() == [102, 103, 104, 105] and t.prev[0, 0].tolist() == [101, 102, 103, 104]
    assert t.teacher_pos[0, 0].tolist() == [1, 2, 3, 4]
    # a=1: x[4] is not a loss token -> slots 2, 3 off, even though x[5] is one
    # a=5: all four targets 6..9 are loss tokens but 9 is past valid length 9
    # a=7: 8 in, 9 past the length, 10, 11 outside the sequence; the padded block is off
    assert t.mask[0].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    decay = [math.exp(-k / 4.0) for k in range(4)]
    assert torch.allclose(t.weight, t.mask * torch.tensor(decay, dtype=torch.float64))


def _draft(args, seed=0) -> DSparkDraft:
    torch.manual_seed(seed)
    d = DSparkDraft(args).double()
    d.init_weights()
    with torch.no_grad():  # away from the init's special values (W2 = 0, norms 1, zero biases)
        for name, p in d.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name else 0.3 if "markov" in name else 0.05))
    g = torch.Generator().manual_seed(seed + 1)
    d.load_frozen_tables(torch.randn(V, H, generator=g, dtype=torch.float64),
                         torch.randn(V, H, generator=g, dtype=torch.float64))
    return d


def _features(seed=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, S), generator=g)
    ids[ids == BASE.mask_token_id] = 0
    mask = torch.rand(2, S, generator=g) > 0.35  # holes inside blocks: the cumulative mask matters
    mask[1] = False
    mask[1, 5:9] = True  # few anchors in row 1: padded anchor slots
    return TargetFeatures(input_ids=ids, loss_mask=mask, valid_lengths=torch.tensor([S, S - 4]),
                          aux_hidden=torch.randn(2, S, 2 * H, generator=g, dtype=torch.float64),
                          last_hidden=torch.randn(2, S, H, generator=g, dtype=torch.float64) * 2)


def _sig(x):
    return 1.0 / (1.0 + torch.exp(-x))


def reference(d: DSparkDraft, f: TargetFeatures, anchors, keep):
    """Loss sum, weight sum and per-slot (logits, confidence) in plain eager fp64, one slot at a
    time, from the parameters themselves (never the heads' forward)."""
    a = d.args
    b, r = a.block_size, a.markov_rank
    hidden = d.block_hidden(f, anchors, keep)[0]
    mh = d.markov_head
    w1, w2, lm = mh.markov_w1.weight, mh.markov_w2.weight, d.target_lm_head
    total, wsum, slots = hidden.new_zeros(()), 0.0, {}
    for bi in range(anchors.shape[0]):
        length = int(f.valid_lengths[bi])
        x = f.input_ids[bi]
        for n in range(anchors.shape[1]):
            anchor, alive = int(anchors[bi, n]), bool(keep[bi, n])
            prev, state = int(x[anchor]), torch.zeros(r, dtype=torch.float64)
            for k in range(b):
                tgt = anchor + k + 1
                alive = alive and tgt < length and bool(f.loss_mask[bi, tgt])
                weight = math.exp(-k / a.loss_gamma) if alive else 0.0
                h = hidden[bi, n * b + k]
                e = w1[prev]
                if a.markov_head_type == "vanilla":
                    feat = e
                elif a.markov_head_type == "gated":
                    gp = mh.gate_proj
                    feat = _sig(gp.weight @ torch.cat([h, e]) + gp.bias) * e
                else:
                    jp = mh.joint_proj
                    zin = torch.cat([state, e, h])
                    gate = _sig(jp.weight[:r] @ zin + jp.bias[:r])
                    cand = torch.tanh(jp.weight[r : 2 * r] @ zin + jp.bias[r : 2 * r])
                    feat = torch.tanh(jp.weight[2 * r :] @ zin + jp.bias[2 * r :])
                    state = gate * state + (1 - gate) * cand
                logits = lm @ h + w2 @ feat
                p = torch.softmax(logits, dim=0)
                pt = torch.softmax(lm @ f.last_hidden[bi, min(anchor + k, S - 1)], dim=0)
                label = int(x[min(tgt, S - 1)])
                ce = -torch.log(p[label])
                l1 = (p - pt).abs().sum()
                cstar = torch.minimum(p, pt).sum().detach()  # sum_v min(p, q) = 1 - |p - q|_1 / 2
                loss = a.ce_loss_weight * ce + a.l1_loss_weight * l1
                conf = None
                if d.confidence_head is not None:
                    cp = d.confidence_head.proj
                    inp = torch.cat([h, e]) if a.confidence_head_with_markov else h
                    conf = _sig(cp.weight[0] @ inp + cp.bias[0])
                    bce = -(cstar * torch.log(conf) + (1 - cstar) * torch.log(1 - conf))
                    loss = loss + a.confidence_loss_weight * bce
                total = total + weight * loss
                wsum += weight
                slots[(bi, n, k)] = (logits.detach(), conf)
                prev = label
    return total, wsum, slots


def _anchors(args, f):
    return sample_anchors(f.loss_mask, f.valid_lengths, args.num_anchors, True, torch.Generator().manual_seed(3))


@pytest.mark.parametrize("with_markov,enabled", [(False, True), (True, False)])
def test_confidence_head_inputs_and_off(with_markov, enabled):
    args = replace(BASE, confidence_head_with_markov=with_markov, enable_confidence_head=enabled)
    f = _features()
    anchors, keep = _anchors(args, f)
    d = _draft(args)
    out = d.forward_with_anchors(f, anchors, keep)
    want, _, _ = reference(d, f, anchors, keep)
    assert out.loss_sum.item() == pytest.approx(want.item(), rel=1e-10)
    assert ("conf_bce" in out.metrics) == enabled
    if enabled:
        assert d.confidence_head.proj.weight.shape == (1, H)


def test_metrics_against_the_reference():
    args = BASE
    f = _features()
    anchors, keep = _anchors(args, f)
    d = _draft(args)
    out = d.forward_with_anchors(f, anchors, keep)
    _, _, slots = reference(d, f, anchors, keep)
    t = build_slot_targets(f.input_ids, f.loss_mask, f.valid_lengths, anchors, keep, 4, 4.0, torch.float64)
    lm = d.target_lm_head
    greedy = prob = argmax_t1 = blocks = 0.0
    per_slot = [[0.0, 0.0] for _ in range(4)]
    conf_err = wsum = 0.0
    for (bi, n, k), (logits, conf) in slots.items():
        if k or not keep[bi, n]:
            continue
        blocks += 1
        run_g = run_p = run_a = 1.0
        for j in range(4):
            if not t.mask[bi, n, j]:
                break
            lj, cj = slots[(bi, n, j)]
            p = torch.softmax(lj, 0)
            pt = torch.softmax(lm @ f.last_hidden[bi, t.teacher_pos[bi, n, j]], 0)
            alpha = float(torch.minimum(p, pt).sum())
            ok = float(int(lj.argmax()) == int(t.labels[bi, n, j]))
            per_slot[j][0] += ok
            per_slot[j][1] += 1
            run_g *= ok
            run_p *= alpha
            run_a *= float(pt[int(lj.argmax())])  # the argmax drafted, accepted at T = 1 with p_t of it
            greedy += run_g
            prob += run_p
            argmax_t1 += run_a
            conf_err += float(t.weight[bi, n, j]) * abs(float(cj) - alpha)
            wsum += float(t.weight[bi, n, j])

    def value(name):
        num, den = out.metrics[name]
        return float(num / den)

    assert value("accept_len") == pytest.approx(1 + greedy / blocks, rel=1e-10)
    assert value("tau_probabilistic") == pytest.approx(1 + prob / blocks, rel=1e-10)
    assert value("tau_argmax_t1") == pytest.approx(1 + argmax_t1 / blocks, rel=1e-10)
    assert value("conf_abs_error") == pytest.approx(conf_err / wsum, rel=1e-9)
    for j in range(4):
        num, den = out.metrics[f"acc_{j}"]
        assert (float(num), float(den)) == (per_slot[j][0], per_slot[j][1])


@pytest.mark.parametrize("soft_labels", [False, True])
def test_chunked_distill_equals_autograd_and_is_chunk_invariant(soft_labels):
    g = torch.Generator().manual_seed(5)
    n = 11
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64, requires_grad=True)
    feats = torch.randn(n, R, generator=g, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(V, R, generator=g, dtype=torch.float64, requires_grad=True)
    lm = torch.randn(V, H, generator=g, dtype=torch.float64)
    teacher = torch.randn(n, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (n,), generator=g)
    weight = torch.rand(n, generator=g, dtype=torch.float64)
    weight[3] = 0
    grads = []
    for chunk in (3, 64):
        out = markov_distill(hidden, feats, w2, lm, teacher, labels, weight, ce_weight=0.3, l1_weight=0.7,
                             chunk_rows=chunk, soft_labels=soft_labels)
        (2.5 * out.loss_sum).backward()
        grads.append([t.grad.clone() for t in (hidden, feats, w2)])
        for t in (hidden, feats, w2):
            t.grad = None
    z = hidden @ lm.T + feats @ w2.T
    p, pt = torch.softmax(z, -1), torch.softmax(teacher @ lm.T, -1)
    hard = torch.nn.functional.cross_entropy(z, labels, reduction="none")
    ce = -(pt * z.log_softmax(-1)).sum(-1) if soft_labels else hard
    want = (weight * (0.3 * ce + 0.7 * (p - pt).abs().sum(-1))).sum()
    (2.5 * want).backward()
    assert out.loss_sum.item() == pytest.approx(want.item(), rel=1e-12)
    assert torch.allclose(out.ce, ce.detach()) and torch.equal(out.argmax, z.argmax(-1))
    for got in grads:
        for gt, t in zip(got, (hidden, feats, w2)):
            assert torch.allclose(gt, t.grad, rtol=1e-10, atol=1e-12)


def test_teacher_read_by_position_equals_one_teacher_row_a_row():
    """The target's rows given once per position (teacher_index) give the same loss, statistics
    and gradients as one gathered row per slot row, whether a chunk's span of positions is
    narrower than the chunk (the lm_head runs over the span) or not (one row a row); rows of
    weight 0 may point anywhere, as padded anchor slots point at position 0."""
    g = torch.Generator().manual_seed(11)
    seq, b = 12, 4
    anchors = [[0, 1, 3, 4, 6, 0], [2, 3, 5, 7, 8, 0]]  # sorted; the last slot of each is padding
    idx, weight = [], []
    for bi, row in enumerate(anchors):
        for n, a in enumerate(row):
            for k in range(b):
                idx.append(bi * seq + min(a + k, seq - 1))
                weight.append(0.0 if n == len(row) - 1 else float(torch.rand((), generator=g)) + 0.1)
    idx, weight = torch.tensor(idx), torch.tensor(weight, dtype=torch.float64)
    n = idx.shape[0]
    teacher = torch.randn(2 * seq, H, generator=g, dtype=torch.float64)
    lm = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (n,), generator=g)
    leaves = [torch.randn(n, H, generator=g, dtype=torch.float64), torch.randn(n, R, generator=g, dtype=torch.float64),
              torch.randn(V, R, generator=g, dtype=torch.float64)]
    live = weight > 0

    def run(chunk, by_position, spans=None):
        ins = [t.clone().requires_grad_() for t in leaves]
        kw = dict(teacher_index=idx, spans=spans) if by_position else {}
        out = markov_distill(*ins, lm, teacher if by_position else teacher[idx], labels, weight, ce_weight=0.3,
                             l1_weight=0.7, chunk_rows=chunk, **kw)
        (1.5 * out.loss_sum).backward()
        return out, [t.grad for t in ins]

    for chunk in (3, 8, 16, 64):
        spans = teacher_spans(idx, weight, chunk)
        widths = [hi - lo + 1 for lo, hi in spans]
        if chunk == 16:  # two of three chunks read fewer positions than they have rows
            assert sum(w < chunk for w in widths) >= 2
        for c, span in enumerate(spans):  # the narrowest span holding every live row's position
            rows = slice(c * chunk, min((c + 1) * chunk, n))
            pos = [int(i) for i, ok in zip(idx[rows], live[rows]) if ok]
            assert span == ((min(pos), max(pos)) if pos else (0, 0))
        want, want_g = run(chunk, False)
        got, got_g = run(chunk, True)
        assert got.loss_sum.item() == pytest.approx(want.loss_sum.item(), rel=1e-13)
        assert torch.equal(got.argmax, want.argmax) and torch.allclose(got.ce, want.ce, rtol=1e-13)
        assert torch.allclose(got.l1[live], want.l1[live], rtol=1e-12)
        for a, w in zip(got_g, want_g):
            assert torch.allclose(a, w, rtol=1e-12, atol=1e-14)
        # spans started ahead (the model starts them before its layers) are the same spans, and
        # they are the ones used: spans that name only position 0 give other losses
        started = start_teacher_spans(idx, weight, chunk)
        assert started() == spans
        early, early_g = run(chunk, True, started)
        assert torch.equal(early.ce, got.ce) and all(torch.equal(a, b) for a, b in zip(early_g, got_g))
        wrong, _ = run(chunk, True, lambda: [(0, 0)] * len(spans))
        assert not torch.allclose(wrong.l1[live], got.l1[live])
    with pytest.raises(ValueError, match="teacher_index"):
        markov_distill(*leaves, lm, teacher, labels, weight, ce_weight=0.3, l1_weight=0.7,
                       teacher_index=idx.to(torch.int32))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_decoding_equals_training(kind):
    """The proposer's block over a cached context, walked with the data's tokens as previous
    tokens, gives training's slot logits and confidences; its own walk picks their argmaxes."""
    args = replace(BASE, markov_head_type=kind)
    f = _features()
    d = _draft(args).eval()
    anchor = 6
    anchors, keep = torch.tensor([[anchor], [0]]), torch.tensor([[True], [False]])
    _, _, slots = reference(d, f, anchors, keep)
    prop = DSparkProposer(d)
    prop.reset(S)
    x = f.input_ids[0]
    prop.commit(x[:anchor], f.aux_hidden[0, :anchor])
    forced = x[anchor + 1 : anchor + 5].tolist()
    tokens, logits, conf = prop.walk(int(x[anchor]), forced=forced)
    for k in range(4):
        want_logits, want_conf = slots[(0, 0, k)]
        assert torch.allclose(logits[k], want_logits, rtol=1e-9, atol=1e-9), k
        assert float(conf[k]) == pytest.approx(float(want_conf), rel=1e-9)
        assert int(tokens[k]) == int(want_logits.argmax())
    free, _, _ = prop.walk(int(x[anchor]))
    assert torch.equal(free[:1], tokens[:1])


def test_confidence_threshold_stops_the_proposal():
    d = _draft(BASE).eval()
    f = _features()
    prop = DSparkProposer(d)
    prop.reset(S)
    prop.commit(f.input_ids[0, :5], f.aux_hidden[0, :5])
    tokens, _, conf = prop.walk(int(f.input_ids[0, 5]))
    survival = torch.cumprod(conf, 0)
    assert prop.num_draft_tokens == 4 and torch.equal(prop.propose(int(f.input_ids[0, 5])), tokens)
    for thr in (float(survival[1]) - 1e-9, float(survival[1]) + 1e-9, 0.999):
        stop = DSparkProposer(d, confidence_threshold=thr)
        stop.reset(S)
        stop.commit(f.input_ids[0, :5], f.aux_hidden[0, :5])
        keep = int((survival >= thr).sum())
        assert torch.equal(stop.propose(int(f.input_ids[0, 5])), tokens[:keep]), thr
    with pytest.raises(ValueError, match="no confidence head"):
        DSparkProposer(_draft(replace(BASE, enable_confidence_head=False)), confidence_threshold=0.5)


def test_bad_args_name_the_field():
    with pytest.raises(ValueError, match="markov_head_type: 'lstm'"):
        DSparkDraft(replace(BASE, markov_head_type="lstm"))
    with pytest.raises(ValueError, match="markov_rank must be >= 1"):
        DSparkDraft(replace(BASE, markov_rank=0))
    with pytest.raises(ValueError, match="needs the target's final-norm hidden"):
        d = _draft(BASE)
        f = _features()
        f.last_hidden = None
        d(f)


def test_distill_with_a_wide_logit_range_stays_exact_in_fp32():
    """Logits 200 apart (fp32 probabilities there would be subnormal, which the chunk floors):
    loss and gradients still equal the fp64 autograd values to fp32 precision."""
    g = torch.Generator().manual_seed(7)
    n = 6
    hidden = torch.randn(n, H, generator=g) * 12
    feats = torch.randn(n, R, generator=g)
    w2 = torch.randn(V, R, generator=g)
    lm = torch.randn(V, H, generator=g)
    teacher = torch.randn(n, H, generator=g) * 8
    labels = torch.randint(0, V, (n,), generator=g)
    weight = torch.rand(n, generator=g)
    assert ((hidden @ lm.T).amax(-1) - (hidden @ lm.T).amin(-1)).min() > 200
    ins = [t.clone().requires_grad_() for t in (hidden, feats, w2)]
    out = markov_distill(*ins, lm, teacher, labels, weight, ce_weight=0.1, l1_weight=0.9, chunk_rows=4)
    out.loss_sum.backward()
    ref = [t.double().requires_grad_() for t in (hidden, feats, w2)]
    z = ref[0] @ lm.double().T + ref[1] @ ref[2].T
    p, pt = torch.softmax(z, -1), torch.softmax(teacher.double() @ lm.double().T, -1)
    ce = torch.nn.functional.cross_entropy(z, labels, reduction="none")
    want = (weight.double() * (0.1 * ce + 0.9 * (p - pt).abs().sum(-1))).sum()
    want.backward()
    assert out.loss_sum.item() == pytest.approx(want.item(), rel=1e-5)
    for got, r in zip(ins, ref):
        assert torch.allclose(got.grad.double(), r.grad, rtol=1e-4, atol=1e-5 * r.grad.abs().max().item())


def test_compiled_chunk_stats_equal_eager_on_bf16_tables():
    """The CUDA path of the distillation (models/dspark/loss.py: _compiled_chunk_stats, which
    also does the casts and the Markov sum), run through Inductor on CPU on bf16 matmul outputs:
    CE, L1, argmax and the bf16 gradient equal the eager statistics."""
    from models.dspark.loss import _chunk_stats, _compiled_chunk_stats

    g = torch.Generator().manual_seed(3)
    c, v = 24, 640
    z_head = (torch.randn(c, v, generator=g) * 4).bfloat16()
    z_markov = (torch.randn(c, v, generator=g) * 0.5).bfloat16()
    z_teacher = (torch.randn(c, v, generator=g) * 4).bfloat16()
    labels = torch.randint(0, v, (c,), generator=g)
    weight = torch.rand(c, generator=g)
    torch._dynamo.reset()
    got = _compiled_chunk_stats(z_head, z_markov, z_teacher, labels, weight, 0.1, 0.9, True,
                                torch.float32, torch.bfloat16)
    want = _chunk_stats(z_head, z_markov, z_teacher, labels, weight, 0.1, 0.9, True, torch.float32, torch.bfloat16)
    torch._dynamo.reset()
    for a, b in zip(got[:2], want[:2]):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[2], want[2])
    torch.testing.assert_close(got[4], want[4], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(want[4], torch.softmax(z_teacher.float(), -1).gather(1, want[2][:, None])[:, 0])
    assert got[3].dtype == torch.bfloat16
    torch.testing.assert_close(got[3].float(), want[3].float(), rtol=2e-2, atol=1e-6)
    # and the eager statistics are those of z = z_head + z_markov in fp32
    z = z_head.float() + z_markov.float()
    torch.testing.assert_close(want[0], torch.nn.functional.cross_entropy(z, labels, reduction="none"))
