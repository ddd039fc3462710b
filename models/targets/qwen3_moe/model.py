"""Frozen Qwen3-MoE target: the Qwen3 target with a routed-experts MLP in its sparse layers.

Everything but the feed-forward (attention, capture, packing, decoding with a cache) is
``Qwen3Model``'s, so a change there reaches this family too.
"""

from __future__ import annotations

from torch import nn

from models.common import SwiGLU
from models.targets.qwen3.model import Qwen3DecoderLayer, Qwen3Model
from models.targets.qwen3_moe.args import Qwen3MoeArgs
from models.targets.qwen3_moe.moe import SparseMoE


class Qwen3MoeModel(Qwen3Model):
    """Qwen3-MoE decoder (HF names as ``Qwen3MoeForCausalLM``'s without ``model.``; the
    experts' weights are stacked, see ``state_dict.py``)."""

    args: Qwen3MoeArgs

    def build_layer(self, layer_id: int) -> nn.Module:
        a = self.args
        if a.is_sparse_layer(layer_id):
            mlp = SparseMoE(a.hidden_size, a.moe_intermediate_size, a.num_experts, a.num_experts_per_tok,
                            a.norm_topk_prob)
        else:
            mlp = SwiGLU(a.hidden_size, a.intermediate_size)
        return Qwen3DecoderLayer(a, mlp=mlp)
