"""models/targets/qwen3: capture convention, early stop, HF checkpoint loading."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from models.targets.qwen3 import (
    Qwen3Model,
    hf_key_to_local,
    load_hf_state_dict,
    local_key_to_hf,
    qwen3_flavors,
)

ARGS = replace(
    qwen3_flavors["debugmodel"], vocab_size=97, hidden_size=32, intermediate_size=48, head_dim=8,
    tie_word_embeddings=False,
)


def _model(seed=0, **kw) -> Qwen3Model:
    m = Qwen3Model(replace(ARGS, **kw)).double()
    m.init_weights(seed)
    return m


def _reference_hidden_states(model: Qwen3Model, ids: torch.Tensor) -> list[torch.Tensor]:
    """HF-style hidden_states list [embeddings, layer 0 out, ...] from plain tensor ops."""
    a = model.args
    p = {k: v.detach() for k, v in model.state_dict().items()}

    def rms(x, w):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + a.rms_norm_eps) * w

    def rope(x, pos):  # x [S, heads, D]
        d = x.shape[-1]
        inv = torch.tensor([a.rope_theta ** (-2 * i / d) for i in range(d // 2)], dtype=x.dtype)
        ang = pos[:, None].to(x.dtype) * inv  # [S, D/2]
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    states = []
    for b in range(ids.shape[0]):
        x = p["embed_tokens.weight"][ids[b]]
        seq = [x]
        pos = torch.arange(ids.shape[1])
        for i in range(a.num_hidden_layers):
            pre = f"layers.{i}."
            n = rms(x, p[pre + "input_layernorm.weight"])
            q = (n @ p[pre + "self_attn.q_proj.weight"].t()).view(
                -1, a.num_attention_heads, a.head_dim
            )
            k = (n @ p[pre + "self_attn.k_proj.weight"].t()).view(
                -1, a.num_key_value_heads, a.head_dim
            )
            v = (n @ p[pre + "self_attn.v_proj.weight"].t()).view(
                -1, a.num_key_value_heads, a.head_dim
            )
            q = rope(rms(q, p[pre + "self_attn.q_norm.weight"]), pos)
            k = rope(rms(k, p[pre + "self_attn.k_norm.weight"]), pos)
            heads = []
            for hh in range(a.num_attention_heads):
                kv = hh // (a.num_attention_heads // a.num_key_value_heads)
                sc = q[:, hh] @ k[:, kv].t() / math.sqrt(a.head_dim)
                sc = sc.masked_fill(
                    torch.triu(torch.ones_like(sc, dtype=torch.bool), 1), float("-inf")
                )
                heads.append(torch.softmax(sc, -1) @ v[:, kv])
            x = x + torch.cat(heads, -1) @ p[pre + "self_attn.o_proj.weight"].t()
            m = rms(x, p[pre + "post_attention_layernorm.weight"])
            gate = m @ p[pre + "mlp.gate_proj.weight"].t()
            up = m @ p[pre + "mlp.up_proj.weight"].t()
            x = x + (torch.nn.functional.silu(gate) * up) @ p[pre + "mlp.down_proj.weight"].t()
            seq.append(x)
        states.append(seq)
    return [torch.stack([s[j] for s in states]) for j in range(a.num_hidden_layers + 1)]


def test_capture_matches_reference_and_layer_convention():
    model = _model()
    ids = torch.randint(0, ARGS.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    hs = _reference_hidden_states(model, ids)
    layer_ids = [4, 0, 2]
    aux, last = model.capture(ids, layer_ids, need_last_hidden=True)
    h = ARGS.hidden_size
    assert aux.shape == (2, 11, 3 * h) and not aux.requires_grad
    for j, lid in enumerate(layer_ids):  # id i == HF hidden_states[i + 1], in the asked order
        torch.testing.assert_close(aux[..., j * h : (j + 1) * h], hs[lid + 1])
    p = model.state_dict()
    ref_last = (
        hs[-1]
        / torch.sqrt((hs[-1] ** 2).mean(-1, keepdim=True) + ARGS.rms_norm_eps)
        * p["norm.weight"]
    )
    torch.testing.assert_close(last, ref_last)
    torch.testing.assert_close(model(ids), ref_last @ p["lm_head.weight"].t())


def test_capture_early_stop_same_aux_and_skips_layers():
    model = _model()
    ids = torch.randint(0, ARGS.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    ran: list[str] = []
    for name, layer in model.layers.items():
        layer.register_forward_hook(lambda mod, inp, out, name=name: ran.append(name))
    full, _ = model.capture(ids, [1, 2], need_last_hidden=True)
    assert ran == [str(i) for i in range(ARGS.num_hidden_layers)]
    ran.clear()
    early, last = model.capture(ids, [1, 2], need_last_hidden=False)
    assert ran == ["0", "1", "2"] and last is None
    assert torch.equal(full, early)
    with pytest.raises(ValueError, match="out of range"):
        model.capture(ids, [ARGS.num_hidden_layers], need_last_hidden=False)
    with pytest.raises(ValueError, match=r"\[-1\] out of range"):
        model.capture(ids, [0, -1], need_last_hidden=False)
    with pytest.raises(ValueError, match="layer_ids is empty"):
        model.capture(ids, [], need_last_hidden=False)


def test_compiled_capture_equals_eager_in_one_graph_and_leaves_decoding_eager():
    """compile_capture (compile.target): the capture path's layers run one compiled graph that
    every layer reuses, with the eager capture's outputs; decoding with a cache is not compiled."""
    from torch._dynamo.utils import counters

    model = _model().float()
    eager = _model().float()
    ids = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(4))
    torch._dynamo.reset()
    counters.clear()
    model.compile_capture("inductor")
    aux, last = model.capture(ids, [0, 2, 4], need_last_hidden=True)
    want_aux, want_last = eager.capture(ids, [0, 2, 4], need_last_hidden=True)
    torch.testing.assert_close(aux, want_aux, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, want_last, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1 and ARGS.num_hidden_layers > 1
    model.capture(ids, [1], need_last_hidden=False)  # the same graph again, no recompile
    cache = model.new_cache(2, 20)
    step = model(ids[:, :4], [1], False, cache=cache, logits="last")
    want = eager(ids[:, :4], [1], False, cache=eager.new_cache(2, 20), logits="last")
    torch.testing.assert_close(step.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1


def test_init_weights_deterministic():
    a, b, c = _model(seed=3), _model(seed=3), _model(seed=4)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert torch.equal(a.norm.weight, torch.ones_like(a.norm.weight))
    table_std = 1.0 / ARGS.hidden_size**0.5
    assert abs(a.embed_tokens.weight.std().item() - table_std) < 0.1 * table_std
    assert abs(a.layers["0"].mlp.down_proj.weight.std().item() - 0.02) < 0.003


def _save_hf(model: Qwen3Model, folder, shards: int = 1, drop: str | None = None, extra=None):
    sd = {local_key_to_hf(k): v.contiguous() for k, v in model.state_dict().items()}
    if drop:
        del sd[drop]
    sd.update(extra or {})
    if shards == 1:
        save_file(sd, str(folder / "model.safetensors"))
        return
    keys = sorted(sd)
    weight_map = {}
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[s::shards]}
        save_file(part, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


@pytest.mark.parametrize("shards", [1, 3])
def test_hf_round_trip(tmp_path, shards):
    assert hf_key_to_local("model.layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert hf_key_to_local("lm_head.weight") == "lm_head.weight"
    assert local_key_to_hf("norm.weight") == "model.norm.weight"
    src, dst = _model(seed=1), _model(seed=2)
    _save_hf(src, tmp_path, shards)
    load_hf_state_dict(dst, str(tmp_path))
    for k, v in src.state_dict().items():
        assert torch.equal(v, dst.state_dict()[k]), k


def test_hf_load_errors_name_the_key(tmp_path):
    src = _model(seed=1)
    (tmp_path / "a").mkdir()
    _save_hf(src, tmp_path / "a", drop="model.layers.3.mlp.up_proj.weight")
    dst = _model(seed=2)
    before = dst.embed_tokens.weight.clone()
    with pytest.raises(KeyError, match=r"model\.layers\.3\.mlp\.up_proj\.weight"):
        load_hf_state_dict(dst, str(tmp_path / "a"))
    assert torch.equal(dst.embed_tokens.weight, before)  # nothing copied on error

    (tmp_path / "b").mkdir()
    _save_hf(src, tmp_path / "b", extra={"model.layers.0.bogus.weight": torch.zeros(2)})
    with pytest.raises(
        KeyError, match=r"unexpected key 'model\.layers\.0\.bogus\.weight'.*model\.safetensors"
    ):
        load_hf_state_dict(dst, str(tmp_path / "b"))

    (tmp_path / "c").mkdir()
    bad = {"model.norm.weight": torch.ones(ARGS.hidden_size + 1, dtype=torch.float64)}
    _save_hf(src, tmp_path / "c", drop="model.norm.weight", extra=bad)
    with pytest.raises(
        ValueError, match=r"shape mismatch for 'model\.norm\.weight' in .*model\.safetensors"
    ):
        load_hf_state_dict(dst, str(tmp_path / "c"))

    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load_hf_state_dict(dst, str(tmp_path / "missing"))


def test_tied_embeddings(tmp_path):
    src = _model(seed=1, tie_word_embeddings=True)
    assert src.lm_head.weight is src.embed_tokens.weight
    _save_hf(src, tmp_path, drop="lm_head.weight")  # HF tied checkpoints carry no lm_head
    dst = _model(seed=2, tie_word_embeddings=True)
    load_hf_state_dict(dst, str(tmp_path))
    assert torch.equal(dst.lm_head_weight(), src.embed_weight())
