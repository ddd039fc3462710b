"""Qwen3-MoE target: the batched experts forward against a float64 per-expert reference, and
the HF loader's checks on expert keys; per-family config.json features."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from models.targets.qwen3_moe import Qwen3MoeModel, qwen3_moe_flavors
from models.targets.qwen3_moe.moe import SparseMoE
from titan_draft import load_target


def _reference_moe(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """Per token, per chosen expert, in float64: softmax router, top-k, optional renormalization."""
    w = {n: p.detach().double() for n, p in moe.named_parameters()}
    x = x.double().reshape(-1, x.shape[-1])
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(w["gate.weight"] @ x[t], dim=-1)
        top = torch.topk(probs, moe.top_k).indices
        weights = probs[top] / (probs[top].sum() if moe.norm_topk_prob else 1.0)
        for e, g in zip(top.tolist(), weights):
            h = torch.nn.functional.silu(w["experts.gate_proj"][e] @ x[t]) * (w["experts.up_proj"][e] @ x[t])
            out[t] += g * (w["experts.down_proj"][e] @ h)
    return out


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_a_per_token_reference(norm, dtype):
    torch.manual_seed(0)
    moe = SparseMoE(dim=24, hidden_dim=40, num_experts=7, top_k=3, norm_topk_prob=norm)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.gate.weight[6] = -100.0  # expert 6 gets no token: an empty group
    moe.to(dtype)
    x = torch.randn(2, 9, 24).to(dtype)
    # one grouped GEMM (bf16) or one padded bmm (other dtypes) per projection, however many experts
    kernel = "_grouped_mm" if dtype == torch.bfloat16 else "bmm"
    calls = []
    real = getattr(torch, kernel)

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    setattr(torch, kernel, counting)
    try:
        with torch.no_grad():
            got = moe(x)
    finally:
        setattr(torch, kernel, real)
    assert len(calls) == 3
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.double().reshape(-1, 24), _reference_moe(moe, x), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_capture_equals_eager(dtype):
    """compile.target: the MoE layers compile (in bf16 through the grouped GEMM's compile-time
    checks) and capture what eager captures."""
    model = Qwen3MoeModel(qwen3_moe_flavors["debugmodel"])
    model.init_weights(seed=1)
    model.requires_grad_(False)
    model.to(dtype)
    ids = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))
    eager = model.capture(ids, [1, 3])
    model.compile_capture("aot_eager")
    compiled = model.capture(ids, [1, 3])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def _moe_folder(tmp_path) -> tuple[dict, dict, Qwen3MoeModel]:
    args = qwen3_moe_flavors["debugmodel"]
    model = Qwen3MoeModel(args)
    model.init_weights(seed=3)
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue  # tied
        if ".mlp.experts." in k:
            for e in range(v.shape[0]):
                layer, proj = k.rsplit(".", 1)
                sd[f"model.{layer}.{e}.{proj}.weight"] = v[e].contiguous()
        else:
            sd[f"model.{k}"] = v.contiguous()
    cfg = {"model_type": "qwen3_moe", "vocab_size": args.vocab_size, "hidden_size": args.hidden_size,
           "intermediate_size": args.intermediate_size, "num_hidden_layers": args.num_hidden_layers,
           "num_attention_heads": args.num_attention_heads, "num_key_value_heads": args.num_key_value_heads,
           "head_dim": args.head_dim, "tie_word_embeddings": True, "rope_theta": args.rope_theta,
           "num_local_experts": args.num_experts, "num_experts_per_tok": args.num_experts_per_tok,
           "moe_intermediate_size": args.moe_intermediate_size, "norm_topk_prob": True,
           "mlp_only_layers": args.mlp_only_layers, "decoder_sparse_step": 1}
    return cfg, sd, model


def _write(folder, cfg, sd) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def test_loader_stacks_experts_and_names_bad_expert_keys(tmp_path):
    cfg, sd, model = _moe_folder(tmp_path)
    loaded = load_target(_write(tmp_path / "ok", cfg, sd), dtype=torch.float32)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    ids = torch.randint(0, 1000, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))

    expert = "model.layers.0.mlp.experts.3.up_proj.weight"
    missing = {k: v for k, v in sd.items() if k != expert}
    with pytest.raises(KeyError, match=rf"missing keys .*\['{expert}'\]"):
        load_target(_write(tmp_path / "missing", cfg, missing), dtype=torch.float32)
    extra = {**sd, "model.layers.0.mlp.experts.4.up_proj.weight": sd[expert].clone()}  # 4 experts: 0 .. 3
    with pytest.raises(KeyError, match=r"unexpected key 'model.layers.0.mlp.experts.4.up_proj.weight'"):
        load_target(_write(tmp_path / "extra", cfg, extra), dtype=torch.float32)
    dense = {**sd, "model.layers.1.mlp.experts.0.up_proj.weight": sd[expert].clone()}  # layer 1 is mlp_only
    with pytest.raises(KeyError, match=r"unexpected key 'model.layers.1.mlp.experts.0"):
        load_target(_write(tmp_path / "dense", cfg, dense), dtype=torch.float32)
    wrong = {**sd, expert: torch.zeros(sd[expert].shape[0] + 1, sd[expert].shape[1])}
    with pytest.raises(ValueError, match=rf"shape mismatch for '{expert}'"):
        load_target(_write(tmp_path / "shape", cfg, wrong), dtype=torch.float32)


def test_each_family_declares_its_config_features(tmp_path):
    cfg, sd, _ = _moe_folder(tmp_path)
    with pytest.raises(ValueError, match=r"sets attention_bias=true, which the qwen3_moe target family does not"):
        load_target(_write(tmp_path / "bias", {**cfg, "attention_bias": True}, sd), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"enables sliding-window attention, which the qwen3_moe"):
        load_target(_write(tmp_path / "swa", {**cfg, "use_sliding_window": True}, sd), dtype=torch.float32)
    # Qwen2's biases are its architecture: a config that states them is read
    from titan_draft.features.target import read_hf_config

    (tmp_path / "q2").mkdir()
    (tmp_path / "q2" / "config.json").write_text(json.dumps({"model_type": "qwen2", "attention_bias": True}))
    assert read_hf_config(str(tmp_path / "q2"))["model_type"] == "qwen2"
    with pytest.raises(ValueError, match=r"sets mlp_bias=true, which the qwen2 target family"):
        (tmp_path / "q2" / "config.json").write_text(json.dumps({"model_type": "qwen2", "mlp_bias": True}))
        read_hf_config(str(tmp_path / "q2"))


def test_qwen3_30b_a3b_flavor_has_the_published_shape():
    with torch.device("meta"):
        model = Qwen3MoeModel(qwen3_moe_flavors["qwen3_30b_a3b"])
    total = sum(p.numel() for p in model.parameters())
    experts = model.layers["0"].mlp.experts
    assert tuple(experts.gate_proj.shape) == (128, 768, 2048) and tuple(experts.down_proj.shape) == (128, 2048, 768)
    assert all(type(layer.mlp) is SparseMoE for layer in model.layers.values())
    assert 30.0e9 < total < 31.0e9  # "30B" (30.5B with the untied head)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2"])
def test_written_random_folder_is_what_transformers_reads(tmp_path, family):
    """A random-weight target saved by its family (weights + to_hf_config) is the same model to
    transformers: the layout a user's real checkpoint has."""
    transformers = pytest.importorskip("transformers")
    from dataclasses import replace

    from titan_draft.protocols.target_spec import get_target_spec

    spec = get_target_spec(family)
    args = replace(spec.flavors["debugmodel"], vocab_size=500, num_hidden_layers=3)
    model = spec.model_cls(args)
    model.init_weights(seed=11)
    spec.save_hf_checkpoint(model, str(tmp_path), dtype=torch.float32)
    (tmp_path / "config.json").write_text(json.dumps(args.to_hf_config("float32")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.randint(0, 500, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)
    assert load_target(str(tmp_path), dtype=torch.float32).family == family
