"""Qwen3-MoE target architecture and flavors."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from models.targets.qwen3.args import Qwen3Args, hf_decoder_kwargs


@dataclass
class Qwen3MoeArgs(Qwen3Args):
    """A Qwen3-MoE target: Qwen3's attention, and in the sparse layers a softmax router that
    sends each token to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts. Layers listed
    in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid keep a dense SwiGLU of
    ``intermediate_size``."""

    num_experts: int = 128
    """Routed experts per sparse layer (HF ``num_experts``; transformers 5 writes
    ``num_local_experts``)."""
    num_experts_per_tok: int = 8
    """Experts each token is sent to (top-k)."""
    moe_intermediate_size: int = 768
    """Intermediate size of each expert's SwiGLU."""
    norm_topk_prob: bool = False
    """Renormalize the top-k router probabilities to sum to 1 (HF's default is False;
    Qwen3-30B-A3B sets True)."""
    decoder_sparse_step: int = 1
    """Layer ``i`` is sparse when ``(i + 1) % decoder_sparse_step == 0`` (and not in
    ``mlp_only_layers``)."""
    mlp_only_layers: list[int] = field(default_factory=list)
    """Layer ids that keep a dense MLP whatever the step says."""

    @classmethod
    def from_hf_config(cls, config: dict) -> Qwen3MoeArgs:
        """Build from a Qwen3-MoE ``config.json`` dict (HF's defaults where a field is absent)."""
        if config.get("model_type") != "qwen3_moe":
            raise ValueError(f"expected a qwen3_moe config, got model_type={config.get('model_type')!r}")
        kwargs = hf_decoder_kwargs(config, {f.name for f in fields(cls)})
        if "num_experts" not in kwargs and "num_local_experts" in config:
            kwargs["num_experts"] = config["num_local_experts"]
        kwargs["mlp_only_layers"] = list(config.get("mlp_only_layers") or [])
        kwargs.setdefault("rope_theta", 10000.0)
        return cls(**kwargs)

    def __post_init__(self):
        super().__post_init__()
        if self.num_experts > 0 and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"qwen3_moe: num_experts_per_tok {self.num_experts_per_tok} must be in "
                             f"1 .. num_experts ({self.num_experts})")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"qwen3_moe: decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    def to_hf_config(self, torch_dtype: str = "bfloat16") -> dict:
        """``config.json`` dict of an HF ``Qwen3MoeForCausalLM`` with these args."""
        cfg = super().to_hf_config(torch_dtype)
        cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", output_router_logits=False,
                   router_aux_loss_coef=0.001)
        return cfg

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` routes to experts (HF's rule)."""
        return (layer_id not in self.mlp_only_layers and self.num_experts > 0
                and (layer_id + 1) % self.decoder_sparse_step == 0)


qwen3_moe_flavors: dict[str, Qwen3MoeArgs] = {
    "debugmodel": Qwen3MoeArgs(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # Qwen3-30B-A3B's shape (3B of its 30B parameters active per token), for random-weight benchmarks
    "qwen3_30b_a3b": Qwen3MoeArgs(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1e6,
        tie_word_embeddings=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
    ),
}
