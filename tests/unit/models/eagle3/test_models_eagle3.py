"""EAGLE-3 against independent float64 references: the training-time-test mask, the loss and its
gradient, the draft vocabulary, the export round trip, and decoding that equals training."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from models.common import dense_mask_from_mask_mod
from models.eagle3 import Eagle3Draft, Eagle3Proposer, eagle3_capture_layers, eagle3_flavors
from models.eagle3.export import eagle3_from_export, export_eagle3
from models.eagle3.objective import ttt_mask_mod
from models.eagle3.vocab import (build_draft_vocab, count_loss_tokens, load_draft_vocab, save_draft_vocab,
                                 unseen_coverage)
from titan_draft.protocols import TargetFeatures

V, VD, H, L = 97, 40, 32, 6
ARGS = replace(eagle3_flavors["debugmodel"], vocab_size=V, draft_vocab_size=VD, hidden_size=H, intermediate_size=48,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, ttt_steps=3, target_layer_ids=[1, 2, 4],
               num_target_layers=L)


def test_capture_rule():
    assert eagle3_capture_layers(36) == [1, 17, 32] and eagle3_capture_layers(32) == [1, 15, 28]
    assert eagle3_capture_layers(30) == [1, 14, 26]


@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_mask_equals_a_loop(step):
    seq, lengths = 7, torch.tensor([7, 4])
    got = dense_mask_from_mask_mod(ttt_mask_mod(seq, lengths), 2, seq, (step + 1) * seq, "cpu")[:, 0]
    want = torch.zeros_like(got)
    for b in range(2):
        for t in range(seq):
            for s in range(seq):
                want[b, t, s] = s <= t and s < lengths[b]  # step 0: causal, inside the sequence
            for j in range(1, step + 1):
                want[b, t, j * seq + t] = True  # steps 1..step: the query's own position only
    assert torch.equal(got, want)


def _draft(seed=0) -> Eagle3Draft:
    torch.manual_seed(seed)
    d = Eagle3Draft(ARGS).double()
    d.init_weights()
    with torch.no_grad():
        for name, p in d.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
        d.d2t.copy_(torch.tensor(sorted(torch.randperm(V)[:VD].tolist())) - torch.arange(VD))
        d.t2d.zero_()
        d.t2d[d.draft_ids()] = True
    g = torch.Generator().manual_seed(seed + 1)
    d.load_frozen_tables(torch.randn(V, H, generator=g, dtype=torch.float64),
                         torch.randn(V, H, generator=g, dtype=torch.float64))
    return d


def _features(seed=2, seq=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, seq), generator=g)
    mask = torch.rand(2, seq, generator=g) > 0.3
    return TargetFeatures(input_ids=ids, loss_mask=mask, valid_lengths=torch.tensor([seq, seq - 3]),
                          aux_hidden=torch.randn(2, seq, 3 * H, generator=g, dtype=torch.float64),
                          last_hidden=torch.randn(2, seq, H, generator=g, dtype=torch.float64) * 2)


def replace_args(d: Eagle3Draft, **changes) -> Eagle3Draft:
    """``d`` with other args (the same weights): the reference reads ``d.args``."""
    import copy
    other = copy.copy(d)
    other.args = replace(d.args, **changes)
    return other


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [S, heads, d], pos [S]
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _reference_loss(d: Eagle3Draft, f: TargetFeatures) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole training-time test written out per row and per query with plain tensor ops."""
    a, P = d.args, dict(d.named_parameters())
    eps, nh, nkv, hd = a.rms_norm_eps, a.num_attention_heads, a.num_key_value_heads, a.head_dim
    used = d.draft_ids()
    total = torch.zeros((), dtype=torch.float64)
    denom = torch.zeros((), dtype=torch.float64)
    for b in range(f.input_ids.shape[0]):
        ids, n, seq = f.input_ids[b], int(f.valid_lengths[b]), f.input_ids.shape[1]
        zt = f.last_hidden[b] @ d.target_lm_head.t()
        p = torch.softmax(zt[:, used], -1)
        if not a.soft_labels:
            p = torch.nn.functional.one_hot(zt[:, used].argmax(-1), len(used)).double()
        in_vocab = d.t2d[zt.argmax(-1)]
        hidden = f.aux_hidden[b] @ P["fc.weight"].t()
        keys, values = [], []
        for i in range(a.ttt_steps):
            tok = torch.tensor([int(ids[t + 1 + i]) if t + 1 + i < seq else 0 for t in range(seq)])
            z = torch.cat([_rms(d.target_embed[tok], P["midlayer.input_layernorm.weight"], eps),
                           _rms(hidden, P["midlayer.hidden_norm.weight"], eps)], -1)
            pos = torch.arange(seq) + i
            q = _rope((z @ P["midlayer.self_attn.q_proj.weight"].t()).view(seq, nh, hd), pos, a.rope_theta)
            keys.append(_rope((z @ P["midlayer.self_attn.k_proj.weight"].t()).view(seq, nkv, hd), pos, a.rope_theta))
            values.append((z @ P["midlayer.self_attn.v_proj.weight"].t()).view(seq, nkv, hd))
            rows = []
            for t in range(seq):
                heads = []
                for h in range(nh):
                    g = h // (nh // nkv)
                    ks = [keys[0][s, g] for s in range(t + 1) if s < n] + [keys[j][t, g] for j in range(1, i + 1)]
                    vs = [values[0][s, g] for s in range(t + 1) if s < n] + [values[j][t, g] for j in range(1, i + 1)]
                    w = torch.softmax(torch.stack(ks) @ q[t, h] / math.sqrt(hd), -1)
                    heads.append(w @ torch.stack(vs))
                rows.append(torch.cat(heads))
            h1 = hidden + torch.stack(rows) @ P["midlayer.self_attn.o_proj.weight"].t()
            x = _rms(h1, P["midlayer.post_attention_layernorm.weight"], eps)
            mlp = (torch.nn.functional.silu(x @ P["midlayer.mlp.gate_proj.weight"].t())
                   * (x @ P["midlayer.mlp.up_proj.weight"].t())) @ P["midlayer.mlp.down_proj.weight"].t()
            out = h1 + mlp
            logq = torch.log_softmax(_rms(out, P["norm.weight"], eps) @ P["lm_head.weight"].t(), -1)
            for t in range(seq):
                tgt = t + 1 + i  # the teacher position; it predicts x[t + 2 + i]
                if t + 2 + i < n and f.loss_mask[b, t + 2 + i] and in_vocab[tgt]:
                    total = total + a.step_decay**i * -(p[tgt] * logq[t]).sum()
                    denom = denom + (i == 0)
            hidden = out
    return total, denom


@pytest.mark.parametrize("soft_labels", [True, False])
def test_loss_and_gradient_equal_the_reference(soft_labels):
    d, f = _draft(), _features()
    d.args = replace(d.args, soft_labels=soft_labels)
    out = d(f)
    ref, denom = _reference_loss(d, f)
    other, _ = _reference_loss(replace_args(d, soft_labels=not soft_labels), f)
    assert abs(float(ref - other)) > 1e-3  # the two label forms differ on these features
    torch.testing.assert_close(out.loss_sum, ref, rtol=1e-10, atol=1e-10)
    assert out.loss_denominator == denom
    params = [p for p in d.parameters() if p.requires_grad]
    got = torch.autograd.grad(out.loss_sum, params)
    want = torch.autograd.grad(ref, params)
    for (name, _), g, w in zip([(n, p) for n, p in d.named_parameters() if p.requires_grad], got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=name)
    assert {k for k in out.metrics} >= {"acc", "acc_0", "acc_2", "ce", "accept_len"}


@pytest.mark.parametrize("train_head", [True, False])
def test_a_frozen_head_stays_the_targets_rows_through_training(train_head):
    """train_lm_head = false: the head is the target's rows of the draft vocabulary, gets no
    optimizer state and does not move in a step, while the rest of the draft trains."""
    from titan_draft.components.optimizer import build_optimizer
    from titan_draft.config.job_config import Optimizer

    torch.manual_seed(0)
    d = Eagle3Draft(replace(ARGS, train_lm_head=train_head)).double()
    d.init_weights()
    g = torch.Generator().manual_seed(1)
    d.load_frozen_tables(torch.randn(V, H, generator=g, dtype=torch.float64),
                         torch.randn(V, H, generator=g, dtype=torch.float64))
    start = {n: p.detach().clone() for n, p in d.named_parameters()}
    assert torch.equal(start["lm_head.weight"], d.target_lm_head[d.draft_ids()])
    opt = build_optimizer(d, Optimizer(lr=1e-2), "cpu")
    d(_features()).loss_sum.backward()
    opt.step()
    moved = {n for n, p in d.named_parameters() if not torch.equal(p, start[n])}
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight"} <= moved
    assert ("lm_head.weight" in moved) == train_head
    assert any(p is d.lm_head.weight for group in opt.param_groups for p in group["params"]) == train_head


def test_the_teacher_distribution_is_kept_for_backward_once():
    """Every TTT step reads the teacher's [B, S, Vd] distribution shifted by one more position.
    Kept for backward per step as a shifted copy, it would cost ttt_steps such tensors; as views
    of one padded tensor it costs one. Counted on the storages of the [B, S, Vd] tensors autograd
    saves: the teacher's and each step's log-softmax output."""
    d, f = _draft(), _features()
    storages = set()

    def pack(t):
        if t.dim() == 3 and t.shape[:2] == f.input_ids.shape and t.shape[2] == VD:
            storages.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        d(f).loss_sum.backward()
    assert len(storages) == ARGS.ttt_steps + 1


def test_draft_vocabulary(tmp_path):
    samples = [([5, 5, 7, 9, 3], [True, True, True, False, True]), ([3, 3, 5, 1], [False, True, True, True])]
    counts = count_loss_tokens(samples, 12)
    assert counts.tolist() == [0, 1, 0, 2, 0, 3, 0, 1, 0, 0, 0, 0]  # 9 and the first 3 are not loss tokens
    for chunk in (1, 2, 3):  # flushed mid-sample and across samples: the same counts
        assert torch.equal(count_loss_tokens(samples, 12, chunk_tokens=chunk), counts)
    d2t, t2d = build_draft_vocab(counts, 4)
    # 5 (3), 3 (2), then 1 and 7 tie at 1: the lower ids win; sorted ascending
    assert (torch.arange(4) + d2t).tolist() == [1, 3, 5, 7] and t2d.nonzero().flatten().tolist() == [1, 3, 5, 7]
    d2t, t2d = build_draft_vocab(counts, 6)  # more room than seen tokens: unseen low ids fill it
    assert (torch.arange(6) + d2t).tolist() == [0, 1, 2, 3, 5, 7]
    path = str(tmp_path / "v.safetensors")
    origin = {"data.source": "a.jsonl", "tokenizer": "t", "draft_vocab_size": 6}
    save_draft_vocab(path, d2t, t2d, counts, origin)
    back = load_draft_vocab(path, origin)
    assert torch.equal(back[0], d2t) and torch.equal(back[1], t2d)
    with pytest.raises(ValueError, match=r"counted with data.source = 'a.jsonl', this job has 'b.jsonl'"):
        load_draft_vocab(path, {**origin, "data.source": "b.jsonl"})


def test_unseen_coverage_counts_one_half_and_measures_the_other():
    """Sample i is counted in half i % 2; the estimate is the share of the second half's loss
    tokens that a vocabulary counted on the first half holds, computed here by hand."""
    samples = [([1, 1, 2], [True, True, True]), ([2, 3, 3], [True, True, False]),
               ([4, 1, 5], [True, True, True]), ([3, 3, 4], [True, True, True])]
    halves = count_loss_tokens(samples, 8, parts=2, chunk_tokens=2)
    assert halves[0].tolist() == [0, 3, 1, 0, 1, 1, 0, 0] and halves[1].tolist() == [0, 0, 1, 3, 1, 0, 0, 0]
    assert torch.equal(halves.sum(0), count_loss_tokens(samples, 8))
    # first half's top 2: 1 (3), then 2, 4 and 5 tie at 1 and the lower id wins: {1, 2}
    # second half's 5 loss tokens: 2 once, 3 three times, 4 once -> only the 2 is covered
    assert unseen_coverage(halves, 2) == pytest.approx(1 / 5)
    assert unseen_coverage(halves, 8) == 1.0  # the whole vocabulary covers everything
    assert math.isnan(unseen_coverage(torch.stack([halves[0], torch.zeros(8, dtype=torch.int64)]), 2))


def test_export_round_trip_and_refusals():
    d = _draft()
    info = {"num_hidden_layers": L, "vocab_size": V, "hidden_size": H}
    tensors, config = export_eagle3(d.state_dict(), d.args, info)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == VD
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert "target_embed" not in tensors and tensors["d2t"].dtype == torch.int64
    args, state = eagle3_from_export(tensors, config)
    back = Eagle3Draft(args).double()
    back.load_state_dict(state, strict=True)
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    with pytest.raises(KeyError, match=r"missing keys \['lm_head.weight'\]"):
        export_eagle3({k: v for k, v in d.state_dict().items() if k != "lm_head.weight"}, d.args, info)
    with pytest.raises(ValueError, match="not an EAGLE-3 draft"):
        eagle3_from_export(tensors, {**config, "architectures": ["DFlashDraftModel"]})


@torch.no_grad()
def test_decoding_chain_equals_the_training_steps():
    """After committing x_0 .. x_n and proposing from x_{n+1}... the chain's step j, fed the gold
    tokens, is training's step j at position n (the newest position with features)."""
    from models.eagle3.objective import _shift

    d, f = _draft(), _features(seq=12)
    f = TargetFeatures(input_ids=f.input_ids[:1], loss_mask=f.loss_mask[:1], valid_lengths=torch.tensor([12]),
                       aux_hidden=f.aux_hidden[:1], last_hidden=f.last_hidden[:1])
    a, ids = d.args, f.input_ids[0]
    # training's per-step outputs, by running the objective's loop pieces
    hidden, past, steps = d.fuse(f.aux_hidden), [], []
    pos = torch.arange(12)[None]
    for i in range(a.ttt_steps):
        mask = dense_mask_from_mask_mod(ttt_mask_mod(12, f.valid_lengths), 1, 12, (i + 1) * 12, "cpu")
        out, kv = d.midlayer(d.embed(_shift(f.input_ids, 1 + i), torch.float64), hidden,
                             d.rope(pos + i, torch.float64), past, mask)
        past.append(kv)
        steps.append(out)
        hidden = out
    n = 6
    prop = Eagle3Proposer(d, num_draft_tokens=a.ttt_steps)
    prop.commit(ids[:3], f.aux_hidden[0, :3])  # committed in pieces, as decoding does
    prop.commit(ids[3 : n + 1], f.aux_hidden[0, 3 : n + 1])
    picks, outs = prop.chain(int(ids[n + 1]), forced=[int(ids[n + 2 + j]) for j in range(a.ttt_steps - 1)])
    for j, out in enumerate(outs):
        torch.testing.assert_close(out[0, 0], steps[j][0, n], rtol=0, atol=1e-12)
    assert prop.length == n + 1  # every committed position's step-0 entry is context now


def test_flops_count_every_linear_once_per_step():
    from torch import nn

    from models.eagle3 import eagle3_flops
    from titan_draft.protocols.model_spec import get_model_spec

    args = replace(eagle3_flavors["debugmodel"], target_layer_ids=[1, 2, 3], vocab_size=1000)
    with torch.device("meta"):
        model = Eagle3Draft(args)
    seq, bsz, k = 128, 3, args.ttt_steps
    # independent count from the instantiated modules: fc runs once, every other Linear (the
    # decoder layer and the draft lm_head) once per TTT step
    linear = sum(6 * seq * m.in_features * m.out_features * (1 if name == "fc" else k)
                 for name, m in model.named_modules() if isinstance(m, nn.Linear))
    attn = sum(12 * seq * (seq / 2 + j) * args.num_attention_heads * args.head_dim for j in range(k))
    teacher = 2 * seq * args.hidden_size * args.vocab_size
    assert eagle3_flops(args, bsz, seq) == pytest.approx(bsz * (linear + attn + teacher), rel=1e-12)
    assert get_model_spec("eagle3").flops_fn is eagle3_flops


def test_compiled_step_terms_equal_eager_and_compile_once_for_all_steps():
    """The CUDA path of a TTT step's soft CE (models/eagle3/objective.py: _compiled_step_terms),
    run through Inductor on CPU: values and the logits' gradient equal the eager terms, and the 7
    steps' teacher rows (views one row apart in the padded tensor) reuse one graph."""
    from models.eagle3.objective import _compiled_step_terms, _step_terms

    g = torch.Generator().manual_seed(0)
    bsz, seq, vd, steps = 2, 16, 384, 7
    p = torch.softmax(torch.randn(bsz, seq + steps, vd, generator=g) * 3, dim=-1)
    gold = torch.randint(0, vd, (bsz, seq), generator=g)
    weights = torch.rand(bsz, seq, generator=g)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):  # a second graph would raise (fullgraph)
        for i in range(steps):
            logits = (torch.randn(bsz, seq, vd, generator=g) * 4).bfloat16()
            gold[:, i] = logits[:, i].argmax(-1)  # some hits
            results = []
            for fn in (_compiled_step_terms, _step_terms):
                x = logits.clone().requires_grad_(True)
                ce, hit = fn(x, p[:, 1 + i : 1 + i + seq], gold)
                (weights * ce).sum().backward()
                results.append((ce.detach(), hit, x.grad))
            (ce_c, hit_c, g_c), (ce_e, hit_e, g_e) = results
            assert ce_c.dtype == torch.float32 and hit_c.dtype == torch.bool
            torch.testing.assert_close(ce_c, ce_e, rtol=1e-5, atol=1e-5)
            assert torch.equal(hit_c, hit_e) and hit_e[:, i].all()
            torch.testing.assert_close(g_c.float(), g_e.float(), rtol=1e-2, atol=1e-4)
    torch._dynamo.reset()
