"""Targets loaded from HF folders match HF transformers layer for layer (float32)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

LLAMA_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)

CASES = {
    "qwen3_untied": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
                     dict(head_dim=16, tie_word_embeddings=False, rope_theta=1e6)),
    "qwen3_tied": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
                   dict(head_dim=24, tie_word_embeddings=True, rope_theta=1e6)),
    "llama3_scaled": ("llama3", "LlamaConfig", "LlamaForCausalLM",
                      dict(tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA_SCALING)),
    "llama3_plain_tied": ("llama3", "LlamaConfig", "LlamaForCausalLM",
                          dict(tie_word_embeddings=True, rope_theta=10000.0)),
    # Qwen2.5: q/k/v biases (given random values below: HF starts them at zero), no q/k norms
    "qwen2_biases": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM",
                     dict(tie_word_embeddings=False, rope_theta=1e6)),
    "qwen2_tied": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    # Qwen3-MoE: 6 experts, top-2, layer 1 dense (mlp_only_layers); with and without renormalized
    # router weights; the second one also sparse only every 2nd layer (decoder_sparse_step)
    "qwen3_moe_norm_topk": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                            dict(head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                                 norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)),
    "qwen3_moe_raw_topk": ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                           dict(head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                                norm_topk_prob=False, mlp_only_layers=[2], decoder_sparse_step=2,
                                tie_word_embeddings=True)),
}
# HF parameters that start at a constant (norms 1, biases 0, the MoE router 0): random values make
# a missed or misplaced one show
_CONSTANT_AT_INIT = ("norm", "bias", "mlp.gate.weight")


@pytest.mark.parametrize("case", sorted(CASES))
def test_capture_and_logits_match_transformers(tmp_path, case):
    family, config_cls, model_cls, extra = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    hf = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if any(part in name for part in _CONSTANT_AT_INIT):
                p.add_(0.3 * torch.randn_like(p))
    # one case saved as shards + index, the layout of every real multi-GB checkpoint
    hf.save_pretrained(tmp_path, **({"max_shard_size": "100KB"} if case == "qwen3_tied" else {}))
    if case == "qwen3_tied":
        assert (tmp_path / "model.safetensors.index.json").is_file()

    from titan_draft import load_target

    model = load_target(str(tmp_path), dtype=torch.float32, device="cpu")
    assert model.family == family and model.args.num_key_value_heads == 2  # GQA
    if "rope_scaling" in extra:
        assert model.args.rope_scaling and model.args.rope_scaling["rope_type"] == "llama3"
    if family == "qwen3_moe":  # the layers HF makes dense are dense here
        sparse = [type(layer.mlp).__name__ == "SparseMoE" for layer in model.layers.values()]
        assert sparse == [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
        assert sparse.count(False) >= 1 and sparse.count(True) >= 1

    # long enough that positions pass original_max_position_embeddings (the scaled band)
    ids = torch.randint(0, COMMON["vocab_size"], (2, 200), generator=torch.Generator().manual_seed(1))
    # each HF decoder layer's raw output (hidden_states[-1] is post-norm, so hook the layers)
    layer_out = {}
    for i, layer in enumerate(hf.model.layers):
        layer.register_forward_hook(
            lambda m, a, out, i=i: layer_out.__setitem__(i, out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
        layer_ids = [3, 0, 2, 1]  # every layer, in the order asked
        aux, last = model.capture(ids, layer_ids)
        logits = model(ids)
    h = COMMON["hidden_size"]
    for j, i in enumerate(layer_ids):
        torch.testing.assert_close(aux[..., j * h:(j + 1) * h], layer_out[i], rtol=1e-4, atol=1e-4)
        if i + 1 < COMMON["num_hidden_layers"]:  # SGLang id i == HF hidden_states[i + 1]
            torch.testing.assert_close(aux[..., j * h:(j + 1) * h], ref.hidden_states[i + 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, ref.hidden_states[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)

    # the trainer's entry point reads the same folder the same way
    from titan_draft.features.target import build_target
    from titan_draft.config import ConfigManager

    bundle = build_target(ConfigManager().parse_args(["--target.path", str(tmp_path)]), torch.device("cpu"), torch.float32)
    assert bundle.family == family and bundle.info["num_hidden_layers"] == COMMON["num_hidden_layers"]
    with torch.no_grad():
        assert torch.equal(bundle.model.capture(ids, layer_ids, need_last_hidden=False)[0], aux)
