"""The DSpark export as serving engines read it, and the eval decoding as they decode.

The loaders and decode loops below are written here from the engines' contract (SGLang's DSPARK
model and worker; SpecForge a6b6b023 ``DSparkDraftModel`` and its ``spec_generate``), reading
only the export folder's config.json and safetensors, in plain float64 PyTorch with no cache:
they share no code with models/dspark beyond the file format.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from models.dspark import DSparkDraft, dspark_flavors, export_dspark
from models.dspark.export import dspark_from_export
from models.targets.qwen3 import Qwen3Model, qwen3_flavors
from titan_draft.checkpoint.draft_source import load_draft_source
from titan_draft.checkpoint.export import export_draft
from titan_draft.data.chat.prompts import EvalPrompt
from titan_draft.decoding.acceptance import evaluate
from titan_draft.decoding.evaluator import build_eval_draft
from titan_draft.eval import build_proposer

CPU = torch.device("cpu")
V = 97
ARGS = replace(dspark_flavors["debugmodel"], vocab_size=V, target_layer_ids=[1, 4], num_target_layers=6,
               mask_token_id=V - 1, block_size=4, markov_rank=12)
TARGET_INFO = {"num_hidden_layers": 6, "vocab_size": V, "hidden_size": 64}
LEAN, MAX_NEW = 4.0, 24


# ---- the loaders, as each engine reads config.json -------------------------------------------

def sglang_reads(cfg: dict) -> dict:
    """SGLang's DSPARK: the model class from ``architectures``; the heads from top-level fields
    (``dspark.py`` build_markov_head / build_confidence_head); block size, capture ids and mask
    token from ``dflash_config`` first, then top level (``dflash_utils`` / ``dspark_config``)."""
    dfc, dsc = cfg.get("dflash_config") or {}, cfg.get("dspark_config") or {}
    assert "Qwen3DSparkModel" in cfg["architectures"], "SGLang has no DSpark class for these architectures"
    assert cfg.get("speculators_model_type") != "dspark"
    rank = int(cfg.get("markov_rank", 0))
    return {"slots_from": 0, "block_size": dfc.get("block_size", cfg.get("block_size")),
            "target_layer_ids": dfc.get("target_layer_ids", cfg.get("target_layer_ids")),
            "mask_token_id": dsc.get("mask_token_id", cfg.get("mask_token_id", dfc.get("mask_token_id"))),
            "markov_rank": rank, "markov_head_type": str(cfg.get("markov_head_type", "vanilla")).lower(),
            "confidence": True, "confidence_with_markov": bool(cfg.get("confidence_head_with_markov", rank > 0))}


def specforge_reads(cfg: dict) -> dict:
    """SpecForge's ``DSparkDraftModel``: every DSpark field from ``dflash_config`` (absent: no
    Markov head, no confidence head), ``block_size`` from the top level."""
    dfc = cfg.get("dflash_config") or {}
    assert dfc.get("projector_type") in (None, "dspark")
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert dfc.get("attention_mode", "gqa") == ("gqa" if kv < heads else "mha")
    return {"slots_from": 1, "block_size": cfg["block_size"], "target_layer_ids": dfc.get("target_layer_ids"),
            "mask_token_id": dfc.get("mask_token_id"), "markov_rank": int(dfc.get("markov_rank", 0) or 0),
            "markov_head_type": str(dfc.get("markov_head_type", "vanilla")).lower(),
            "confidence": bool(dfc.get("enable_confidence_head", float(dfc.get("confidence_head_alpha", 0)) > 0)),
            "confidence_with_markov": bool(dfc.get("confidence_head_with_markov", False))}


def head_shapes(read: dict, hidden: int, vocab: int) -> dict:
    """The head parameters a loader builds from what it read."""
    r, out = read["markov_rank"], {}
    if r > 0:
        out.update({"markov_head.markov_w1.weight": (vocab, r), "markov_head.markov_w2.weight": (vocab, r)})
        if read["markov_head_type"] == "gated":
            out.update({"markov_head.gate_proj.weight": (r, hidden + r), "markov_head.gate_proj.bias": (r,)})
        elif read["markov_head_type"] == "rnn":
            out.update({"markov_head.joint_proj.weight": (3 * r, 2 * r + hidden),
                        "markov_head.joint_proj.bias": (3 * r,)})
    if read["confidence"]:
        width = hidden + (r if read["confidence_with_markov"] else 0)
        out.update({"confidence_head.proj.weight": (1, width), "confidence_head.proj.bias": (1,)})
    return out


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("reads", [sglang_reads, specforge_reads], ids=["sglang", "specforge"])
def test_every_head_is_built_by_each_loader(kind, reads):
    """Each loader builds exactly the exported heads (no key dropped as unexpected, none left at
    its init) with the block fields the draft was trained with."""
    args = replace(ARGS, markov_head_type=kind)
    torch.manual_seed(0)
    sd = DSparkDraft(args).state_dict()
    tensors, config = export_dspark(sd, args, TARGET_INFO)
    config = json.loads(json.dumps(config))  # as the file holds it
    read = reads(config)
    exported = {k: tuple(v.shape) for k, v in tensors.items() if k.startswith(("markov_head.", "confidence_head."))}
    assert head_shapes(read, args.hidden_size, V) == exported
    assert (read["block_size"], read["mask_token_id"], read["target_layer_ids"]) == (4, V - 1, [1, 4])


def test_export_refuses_what_a_loader_would_misread():
    torch.manual_seed(0)
    sd = DSparkDraft(ARGS).state_dict()
    with pytest.raises(ValueError, match="mask_token_id 97 is outside the target vocabulary"):
        export_dspark(sd, replace(ARGS, mask_token_id=V), TARGET_INFO)
    with pytest.raises(ValueError, match="num_key_value_heads 3 does not divide num_attention_heads 4"):
        export_dspark(sd, replace(ARGS, num_key_value_heads=3), TARGET_INFO)
    _, config = export_dspark(sd, ARGS, TARGET_INFO)
    tensors = dict(sd)
    with pytest.raises(ValueError, match="markov_rank differs between"):
        dspark_from_export(tensors, {**config, "dflash_config": {**config["dflash_config"], "markov_rank": 8}})
    with pytest.raises(ValueError, match="speculators_model_type 'dspark'"):
        dspark_from_export(tensors, {**config, "speculators_model_type": "dspark"})
    # the architecture name titan_draft exports carried before still reads back
    args, _ = dspark_from_export(tensors, {**config, "architectures": ["DSparkDraftModel"]})
    assert args.markov_rank == ARGS.markov_rank


# ---- the engines' decode loop, from the export files alone ------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """Rotate-half RoPE of ``x [heads, L, D]`` at ``pos [L]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.to(torch.float64)[:, None] * inv
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1) * sin


def reference_block_hidden(t: dict, cfg: dict, aux: torch.Tensor, block: torch.Tensor, embed: torch.Tensor):
    """Final-norm rows of the block ``block [b]`` at positions ``n .. n + b - 1`` over the target
    features ``aux [n, K*H]`` of the committed tokens: every block row sees all context rows and
    its whole block; the context enters each layer's keys and values as ``hidden_norm(fc(aux))``."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n, b = aux.shape[0], block.shape[0]
    ctx = _rms(aux @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    x = embed[block]
    pos_q, pos_k = torch.arange(n, n + b), torch.arange(n + b)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, t[p + "input_layernorm.weight"], eps)
        q = _rms((h @ t[p + "self_attn.q_proj.weight"].T).view(b, nh, d), t[p + "self_attn.q_norm.weight"], eps)
        src = torch.cat([ctx, h])
        k = _rms((src @ t[p + "self_attn.k_proj.weight"].T).view(n + b, nkv, d), t[p + "self_attn.k_norm.weight"], eps)
        v = (src @ t[p + "self_attn.v_proj.weight"].T).view(n + b, nkv, d)
        q, k = _rope(q.transpose(0, 1), pos_q, theta), _rope(k.transpose(0, 1), pos_k, theta)
        k, v = k.repeat_interleave(nh // nkv, 0), v.transpose(0, 1).repeat_interleave(nh // nkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / d ** 0.5, -1) @ v
        x = x + att.transpose(0, 1).reshape(b, nh * d) @ t[p + "self_attn.o_proj.weight"].T
        h = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T
    return _rms(x, t["norm.weight"], eps)


def reference_markov_chain(t: dict, read: dict, hidden: torch.Tensor, lm_head: torch.Tensor, anchor: int):
    """Greedy picks of the rows ``hidden [n, H]`` in order, the chain started from the anchor:
    ``logits_j = lm_head h_j + W2 f_j`` with ``f_j`` from the previous pick (and, for 'rnn', a
    state that starts at zero)."""
    w1, w2 = t["markov_head.markov_w1.weight"], t["markov_head.markov_w2.weight"]
    prev, state, picks = anchor, torch.zeros(w1.shape[1], dtype=torch.float64), []
    for h in hidden:
        e = w1[prev]
        if read["markov_head_type"] == "vanilla":
            f = e
        elif read["markov_head_type"] == "gated":
            gate = t["markov_head.gate_proj.weight"] @ torch.cat([h, e]) + t["markov_head.gate_proj.bias"]
            f = torch.sigmoid(gate) * e
        else:
            z = t["markov_head.joint_proj.weight"] @ torch.cat([state, e, h]) + t["markov_head.joint_proj.bias"]
            g, c, o = z.chunk(3)
            state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
            f = torch.tanh(o)
        prev = int((lm_head @ h + w2 @ f).argmax())
        picks.append(prev)
    return picks


def reference_decode(folder: str, reads, target: Qwen3Model, prompt: list[int], max_new: int):
    """The engine's greedy loop with no cache: the block ``[x_n, MASK..]`` after the ``n``
    committed tokens drafts from slot ``slots_from`` on; the target verifies ``[x_n, d_1..]``,
    the agreeing prefix and the target's next token commit. Returns (tokens, proposals,
    accepted, τ as round tokens / rounds)."""
    with open(os.path.join(folder, "config.json")) as fh:
        cfg = json.load(fh)
    t = {k: v.to(torch.float64) for k, v in load_file(os.path.join(folder, "model.safetensors")).items()}
    read = reads(cfg)
    embed, lm_head = target.embed_weight(), target.lm_head_weight()
    b, layers = read["block_size"], read["target_layer_ids"]
    seq = list(prompt)
    tokens = [int(target(torch.tensor([seq]))[0, -1].argmax())]
    proposals, accepted = [], []
    while len(tokens) < max_new:
        committed = seq + tokens[:-1]
        aux, _ = target.capture(torch.tensor([committed]), layers, need_last_hidden=False)
        block = torch.tensor([tokens[-1]] + [read["mask_token_id"]] * (b - 1))
        hidden = reference_block_hidden(t, cfg, aux[0], block, embed)[read["slots_from"]:]
        draft = reference_markov_chain(t, read, hidden, lm_head, tokens[-1])
        logits = target(torch.tensor([committed + [tokens[-1]] + draft]))[0, len(committed):]
        choice = logits.argmax(-1).tolist()
        m = 0
        while m < len(draft) and draft[m] == choice[m]:
            m += 1
        proposals.append(draft)
        accepted.append(m)
        tokens += choice[: m + 1]
    tokens = tokens[:max_new]
    return tokens, proposals, accepted, (len(tokens) - 1) / len(accepted)


class Recorder:
    """A proposer that remembers what it proposed."""

    def __init__(self, inner):
        self.inner, self.proposals = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, last_token):
        out = self.inner.propose(last_token)
        self.proposals.append(out.tolist())
        return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Matrices of a few dozen rows: a second thread only adds synchronization (on a busy 2-core
    machine a float64 Linear of this size took 1.7 ms with two threads, 0.04 ms with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target() -> Qwen3Model:
    m = Qwen3Model(replace(qwen3_flavors["debugmodel"], vocab_size=V, tie_word_embeddings=False)).double().eval()
    m.init_weights(seed=3)
    return m


def _export_folder(target, kind: str, out: str, lean: float) -> str:
    """A random DSpark (every parameter away from its init) of Markov rank V, exported through the
    training exporter. Its Markov head adds ``lean`` to the target's greedy next token after the
    previous token alone (W1 = I, W2 maps token p to that token; 'rnn' reads W1[p] into its
    output), so that rounds accept some drafts and the chain's start matters."""
    args = replace(ARGS, markov_head_type=kind, markov_rank=V)
    torch.manual_seed(1)
    d = DSparkDraft(args).double()
    d.init_weights()
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name else 0.05))
        nxt = target(torch.arange(V)[:, None])[:, -1].argmax(-1)
        head = d.markov_head
        head.markov_w1.weight.copy_(torch.eye(V) + 0.05 * torch.randn(V, V))
        head.markov_w2.weight[nxt, torch.arange(V)] += lean
        if kind == "rnn":  # output gate o = 4 W1[p] (z = [state; W1[p]; h], chunks g, c, o)
            head.joint_proj.weight[2 * V:, V:2 * V] += 4.0 * torch.eye(V)
    return export_draft(d, export_dspark, args, TARGET_INFO, out, dtype="float64")


@pytest.mark.parametrize("kind,decode_as,reads", [
    ("vanilla", None, sglang_reads), ("gated", None, sglang_reads), ("rnn", None, sglang_reads),
    ("vanilla", "specforge_spec_generate", specforge_reads), ("rnn", "specforge_spec_generate", specforge_reads),
], ids=["sglang-vanilla", "sglang-gated", "sglang-rnn", "specforge-vanilla", "specforge-rnn"])
def test_eval_decodes_one_export_as_the_engine_does(target, tmp_path, kind, decode_as, reads):
    """One export, read back by the eval CLI's path (export folder -> draft -> proposer with the
    CLI's options; the default is SGLang's), decodes the same drafts, the same accepted counts and
    the same τ as the engine's loop written above from the files alone."""
    folder = _export_folder(target, kind, str(tmp_path / "export"), lean=LEAN)
    spec, args, state, _ = load_draft_source(folder, "dspark")
    draft = build_eval_draft(spec, args, state, target, CPU, torch.float64)
    proposer = Recorder(build_proposer(spec, draft, {} if decode_as is None else {"decode_as": decode_as}))
    prompts = [torch.randint(0, V - 1, (7 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(3)]
    report = evaluate(target, proposer, [EvalPrompt(f"p{i}", p) for i, p in enumerate(prompts)],
                      max_new_tokens=MAX_NEW, stop_ids=[], device=CPU)
    assert report.lossless == len(prompts)
    start = 0
    for p, rep in zip(prompts, report.prompts):
        tokens, proposals, accepted, tau = reference_decode(folder, reads, target, p, MAX_NEW)
        assert proposer.proposals[start : start + rep.rounds] == proposals
        assert rep.accepted == accepted and rep.new_tokens == len(tokens) and rep.tau == pytest.approx(tau)
        start += rep.rounds
    assert report.tau > 1.0  # drafts are accepted: the same τ is not the trivial 1
    assert {len(d) for d in proposer.proposals} == {ARGS.block_size - (decode_as is not None)}
    # the other engine's loop drafts otherwise on this export: the check above tells them apart
    other = specforge_reads if reads is sglang_reads else sglang_reads
    theirs = reference_decode(folder, other, target, prompts[0], MAX_NEW)[1]
    assert theirs != proposer.proposals[: report.prompts[0].rounds]
