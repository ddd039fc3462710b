"""DSpark's definition (arXiv 2607.05147; DeepSpec's training code) as a plain eager float64
reference, computed one block and one slot at a time from a draft's parameters and the target's
tensors without calling the draft's forward, heads or loss; shared by the CPU test
(tests/unit/models/dspark/test_models_dspark_definition.py) and the GPU one
(tests/gpu/test_dspark_definition_gpu.py). The definition's constants are written here, not
read from the args."""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from models.block_diffusion.layers import sample_anchors
from models.dspark import DSparkDraft, dspark_flavors
from titan_draft.protocols import TargetFeatures

# the definition: term weights (CE, L1, confidence BCE), the slot-weight decay, DeepSpec's recipe
CE_W, L1_W, CONF_W = 0.1, 0.9, 1.0
DECAY = 4.0

V, H, R, S, B = 53, 32, 8, 15, 4
ARGS = replace(dspark_flavors["debugmodel"], vocab_size=V, hidden_size=H, intermediate_size=40,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_layers=2, block_size=B,
               num_anchors=6, markov_rank=R, target_layer_ids=[1, 3], num_target_layers=6, mask_token_id=V - 1,
               ce_chunk_rows=7, loss_gamma=DECAY, ce_loss_weight=CE_W, l1_loss_weight=L1_W,
               confidence_loss_weight=CONF_W, rope_theta=10000.0)


def make_draft(args=ARGS, seed=0, markov_scale=0.3) -> DSparkDraft:
    torch.manual_seed(seed)
    d = DSparkDraft(args).double()
    d.init_weights()
    with torch.no_grad():  # away from the init's special values (W2 = 0, norms 1, zero biases)
        for name, p in d.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name else markov_scale if "markov" in name else 0.05))
    g = torch.Generator().manual_seed(seed + 1)
    d.load_frozen_tables(torch.randn(V, H, generator=g, dtype=torch.float64),
                         torch.randn(V, H, generator=g, dtype=torch.float64))
    return d


def make_features(seed=2) -> TargetFeatures:
    """Two rows: row 0 with holes in its loss mask (the cumulative mask matters), row 1 shorter
    with few loss tokens (padded anchor slots). Tokens are distinct along row 0's answer so that
    a label or teacher read one position off changes the loss."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(V - 1, generator=g)[:S], torch.randint(0, V - 1, (S,), generator=g)])
    mask = torch.ones(2, S, dtype=torch.bool)
    mask[0, :2] = False
    mask[0, 7] = False
    mask[0, 11] = False
    mask[1] = False
    mask[1, 4:9] = True
    return TargetFeatures(input_ids=ids, loss_mask=mask, valid_lengths=torch.tensor([S, S - 3]),
                          aux_hidden=torch.randn(2, S, 2 * H, generator=g, dtype=torch.float64),
                          last_hidden=torch.randn(2, S, H, generator=g, dtype=torch.float64) * 2)


# ---- the independent reference ----------------------------------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, pos, theta):
    """Rotate-half RoPE of ``x [heads, L, D]`` at integer positions ``pos [L]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def ref_block_rows(d: DSparkDraft, aux: torch.Tensor, tokens: torch.Tensor, anchor: int) -> torch.Tensor:
    """DFlash's block anchored at ``anchor``: inputs ``[x_a, MASK, ..]`` at positions
    ``a .. a + b - 1``; every slot attends to the context ``hidden_norm(fc(aux[u]))`` for
    ``u < a`` only (the anchor's own features do not exist yet at decoding) and to its whole
    block; pre-norm Qwen3 layers; final norm. Returns the ``[b, H]`` rows, slot 0 first."""
    a, P = d.args, dict(d.named_parameters())
    eps, nh, nkv, hd = a.rms_norm_eps, a.num_attention_heads, a.num_key_value_heads, a.head_dim
    b = a.block_size
    ctx = _rms(aux[:anchor] @ P["fc.weight"].T, P["hidden_norm.weight"], eps)
    x = d.target_embed[torch.tensor([int(tokens[anchor])] + [a.mask_token_id] * (b - 1))]
    pos_q = torch.arange(anchor, anchor + b)
    pos_k = torch.cat([torch.arange(anchor), pos_q])
    for i in range(a.num_layers):
        p = f"layers.{i}."
        h = _rms(x, P[p + "input_layernorm.weight"], eps)
        q = _rms((h @ P[p + "self_attn.q_proj.weight"].T).view(b, nh, hd), P[p + "self_attn.q_norm.weight"], eps)
        src = torch.cat([ctx, h])
        k = _rms((src @ P[p + "self_attn.k_proj.weight"].T).view(-1, nkv, hd), P[p + "self_attn.k_norm.weight"], eps)
        v = (src @ P[p + "self_attn.v_proj.weight"].T).view(-1, nkv, hd)
        q, k = _rotate(q.transpose(0, 1), pos_q, a.rope_theta), _rotate(k.transpose(0, 1), pos_k, a.rope_theta)
        k, v = k.repeat_interleave(nh // nkv, 0), v.transpose(0, 1).repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), -1) @ v
        x = x + att.transpose(0, 1).reshape(b, nh * hd) @ P[p + "self_attn.o_proj.weight"].T
        h = _rms(x, P[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(h @ P[p + "mlp.gate_proj.weight"].T) * (h @ P[p + "mlp.up_proj.weight"].T)) \
            @ P[p + "mlp.down_proj.weight"].T
    return _rms(x, P["norm.weight"], eps)


def _sig(x):
    return 1.0 / (1.0 + torch.exp(-x))


def ref_markov_feature(d: DSparkDraft, h, prev: int, state):
    """The sequential head's rank-r feature of slot ``h`` after token ``prev``: ``(f, W1[prev],
    next state)``. vanilla ``W1[x]``; gated ``sigmoid(G [h; W1[x]] + g) * W1[x]``; rnn
    ``z = [s; W1[x]; h]``, gate/candidate/output thirds of one Linear, ``f = tanh(o)``."""
    mh, r = d.markov_head, d.args.markov_rank
    e = mh.markov_w1.weight[prev]
    kind = d.args.markov_head_type
    if kind == "vanilla":
        return e, e, state
    if kind == "gated":
        return _sig(mh.gate_proj.weight @ torch.cat([h, e]) + mh.gate_proj.bias) * e, e, state
    W, c = mh.joint_proj.weight, mh.joint_proj.bias
    z = torch.cat([state, e, h])
    gate = _sig(W[:r] @ z + c[:r])
    cand = torch.tanh(W[r:2 * r] @ z + c[r:2 * r])
    return torch.tanh(W[2 * r:] @ z + c[2 * r:]), e, gate * state + (1 - gate) * cand


def reference_step(d: DSparkDraft, f: TargetFeatures, anchors, keep):
    """DSpark's training loss of these blocks from the definition: slot k of the block at ``a``
    predicts ``x[a + k + 1]`` with previous token ``x[a + k]`` (the anchor for slot 0), is taught
    by ``p_t = softmax(lm_head(t[a + k]))`` (``t`` the target's final-norm hidden), weighs
    ``exp(-k / 4)`` while every slot up to it has its label inside the sequence and a loss token;
    ``L = 0.1 CE + 0.9 sum_v |p_d - p_t| + 1.0 BCE(c, 1 - |p_d - p_t|_1 / 2)``, each term divided
    by the sum of the weights. Returns (loss, sum of weights, per-term means, per-slot records)."""
    a = d.args
    lm, w2 = d.target_lm_head, d.markov_head.markov_w2.weight
    sums = {"ce": 0.0, "l1": 0.0, "bce": 0.0}
    wsum, slots = 0.0, {}
    for bi in range(anchors.shape[0]):
        x, length = f.input_ids[bi], int(f.valid_lengths[bi])
        for n in range(anchors.shape[1]):
            if not keep[bi, n]:
                continue
            anchor = int(anchors[bi, n])
            rows = ref_block_rows(d, f.aux_hidden[bi], x, anchor)
            alive, state = True, torch.zeros(a.markov_rank, dtype=torch.float64)
            for k in range(a.block_size):
                label_pos = anchor + k + 1
                alive = alive and label_pos < length and bool(f.loss_mask[bi, label_pos])
                if not alive:
                    break  # every later slot has weight 0
                weight = math.exp(-k / DECAY)
                h = rows[k]
                feat, e, state = ref_markov_feature(d, h, int(x[anchor + k]), state)
                p = torch.softmax(lm @ h + w2 @ feat, 0)
                pt = torch.softmax(lm @ f.last_hidden[bi, anchor + k], 0)
                ce = -torch.log(p[int(x[label_pos])])
                l1 = sum((p[v] - pt[v]).abs() for v in range(V))  # every vocabulary entry
                sums["ce"] = sums["ce"] + weight * ce
                sums["l1"] = sums["l1"] + weight * l1
                conf = None
                if d.confidence_head is not None:
                    cstar = (1.0 - 0.5 * l1).detach()
                    cp = d.confidence_head.proj
                    inp = torch.cat([h, e]) if a.confidence_head_with_markov else h
                    conf = _sig(cp.weight[0] @ inp + cp.bias[0])
                    sums["bce"] = sums["bce"] - weight * (cstar * torch.log(conf) + (1 - cstar) * torch.log(1 - conf))
                wsum += weight
                slots[(bi, n, k)] = (p.detach(), pt, conf)
    means = {t: v / wsum for t, v in sums.items()}
    loss = CE_W * means["ce"] + L1_W * means["l1"] + CONF_W * means["bce"]
    return loss, wsum, means, slots


def make_anchors(f, n=ARGS.num_anchors, seed=3):
    """Anchors as the trainer samples them (every candidate ``t`` with loss tokens at ``t`` and
    ``t + 1``), checked against that rule here."""
    anchors, keep = sample_anchors(f.loss_mask, f.valid_lengths, n, True, torch.Generator().manual_seed(seed))
    for bi in range(2):
        got = sorted(int(t) for t, k in zip(anchors[bi], keep[bi]) if k)
        cand = [t for t in range(S - 1) if f.loss_mask[bi, t] and f.loss_mask[bi, t + 1]
                and t + 1 < int(f.valid_lengths[bi])]
        assert set(got) <= set(cand) and len(got) == min(n, len(cand))
    return anchors, keep


def ref_greedy_chain(d: DSparkDraft, rows, anchor_token: int, data_tokens: list[int] | None) -> list[int]:
    """Greedy picks of the block ``rows [b, H]``: slot k's previous token is the pick of slot
    k - 1 (``data_tokens``: the data's token there instead), the anchor's for slot 0."""
    lm, w2 = d.target_lm_head, d.markov_head.markov_w2.weight
    picks, prev, state = [], anchor_token, torch.zeros(d.args.markov_rank, dtype=torch.float64)
    for k in range(rows.shape[0]):
        feat, _, state = ref_markov_feature(d, rows[k], prev, state)
        picks.append(int((lm @ rows[k] + w2 @ feat).argmax()))
        prev = picks[-1] if data_tokens is None else data_tokens[min(k, len(data_tokens) - 1)]
    return picks
