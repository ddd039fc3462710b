"""EAGLE-3 draft: one decoder layer (``midlayer``) on the fused target features, unrolled
``ttt_steps`` times in training (training-time test).

Step 0 at position t reads the fused capture-layer features g_t = fc([low, mid, high]_t) and
the next token x_{t+1}, and predicts x_{t+2}. Step j feeds the draft's own pre-norm output of
step j - 1 at the same position as its hidden input, with the token x_{t+1+j} and RoPE position
t + j, and attends to step 0's keys causally plus the keys of steps 1..j at its own position
(objective.py's mask). Parameter FQNs are SGLang's ``LlamaForCausalLMEagle3`` serving names;
``d2t`` / ``t2d`` are persistent buffers (checkpointed and exported); the target's embedding
and lm_head are frozen, non-persistent buffers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.common import RMSNorm, SwiGLU, apply_rope, attention, rope_cos_sin
from models.common.tensor_utils import register_frozen_tables
from models.eagle3.args import Eagle3Args
from models.eagle3.ttt_attention import DiagonalPast, diagonal_attention

Rope = tuple[torch.Tensor, torch.Tensor]
KV = tuple[torch.Tensor, torch.Tensor]


class Eagle3Attention(nn.Module):
    """Llama attention whose q/k/v read ``[embedding-norm ; hidden-norm]`` (2H wide)."""

    def __init__(self, args: Eagle3Args):
        super().__init__()
        h, d = args.hidden_size, args.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = args.num_attention_heads, args.num_key_value_heads, d
        self.q_proj = nn.Linear(2 * h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)

    def forward(self, z: torch.Tensor, rope: Rope, past: list[KV] | DiagonalPast, attn_mask) -> tuple[torch.Tensor, KV]:
        """``z [B, T, 2H]`` -> output ``[B, T, H]`` and this step's keys/values, the queries
        attending to ``past`` steps' keys and values followed by their own (a :class:`DiagonalPast`:
        the same attention in diagonal form, models/eagle3/ttt_attention.py)."""
        bsz, t, _ = z.shape
        q = apply_rope(self.q_proj(z).view(bsz, t, self.n_heads, self.head_dim).transpose(1, 2), *rope)
        k, v = self.keys_values(z, rope)
        if isinstance(past, DiagonalPast):  # training's diagonal form; attn_mask is step 0's
            o = diagonal_attention(q, k, v, past, attn_mask)
        else:
            keys = torch.cat([pk for pk, _ in past] + [k], dim=2)
            values = torch.cat([pv for _, pv in past] + [v], dim=2)
            o = attention(q, keys, values, attn_mask)
        return self.o_proj(o.transpose(1, 2).reshape(bsz, t, -1)), (k, v)

    def keys_values(self, z: torch.Tensor, rope: Rope) -> KV:
        """This step's rotated keys and values ``[B, Hkv, T, D]`` of ``z [B, T, 2H]``."""
        bsz, t, _ = z.shape
        k = self.k_proj(z).view(bsz, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(z).view(bsz, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        # contiguous: the next steps read these, and FSDP2 warns on a block returning views
        return apply_rope(k, *rope), v.contiguous()


class Eagle3Layer(nn.Module):
    """``h' = hidden + attn([in_norm(emb) ; hidden_norm(hidden)])``, ``out = h' + mlp(post_norm(h'))``
    (the residual runs on the un-normalized hidden input)."""

    def __init__(self, args: Eagle3Args):
        super().__init__()
        h = args.hidden_size
        self.input_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, args.rms_norm_eps)
        self.self_attn = Eagle3Attention(args)
        self.post_attention_layernorm = RMSNorm(h, args.rms_norm_eps)
        self.mlp = SwiGLU(h, args.intermediate_size)

    def forward(self, emb, hidden, rope: Rope, past: list[KV], attn_mask) -> tuple[torch.Tensor, KV]:
        a, kv = self.self_attn(self._attention_input(emb, hidden), rope, past, attn_mask)
        h = hidden + a
        return h + self.mlp(self.post_attention_layernorm(h)), kv

    def keys_values(self, emb, hidden, rope: Rope) -> KV:
        """The keys and values :meth:`forward` would give, without its attention and MLP (a
        decoder's cache entries of committed positions: nothing reads their outputs)."""
        return self.self_attn.keys_values(self._attention_input(emb, hidden), rope)

    def _attention_input(self, emb, hidden) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)


class Eagle3Draft(nn.Module):
    """Trainable: ``fc``, ``midlayer``, ``norm``, ``lm_head`` ([Vd, H]; frozen where
    ``train_lm_head`` is false). Buffers: ``d2t``, ``t2d``
    (the draft vocabulary), ``target_embed`` / ``target_lm_head`` (frozen, not saved)."""

    def __init__(self, args: Eagle3Args):
        super().__init__()
        if not args.target_layer_ids:
            raise ValueError("Eagle3Args.target_layer_ids is empty: resolve the capture layers first")
        self.args = args
        h = args.hidden_size
        self.fc = nn.Linear(args.fc_in_features, h, bias=False)
        self.midlayer = Eagle3Layer(args)
        self.norm = RMSNorm(h, args.rms_norm_eps)
        self.lm_head = nn.Linear(h, args.draft_vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(args.train_lm_head)
        self.register_buffer("d2t", torch.zeros(args.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(args.vocab_size, dtype=torch.bool))
        self.register_buffer("target_embed", torch.empty(0, h), persistent=False)
        self.register_buffer("target_lm_head", torch.empty(0, h), persistent=False)
        self._head_from_target = False

    # ----- DraftModel protocol -----

    @torch.no_grad()
    def init_weights(self) -> None:
        """Linears normal(0, 0.02), norms 1, the draft vocabulary from ``draft_vocab_file`` (the
        first ``draft_vocab_size`` ids without one); ``lm_head`` then starts as the target's
        own head rows of those tokens, copied by :meth:`load_frozen_tables`."""
        from models.eagle3.vocab import load_draft_vocab_tensors

        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                module.reset_parameters()
        d2t, t2d = load_draft_vocab_tensors(self.args)
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self._head_from_target = True

    @torch.no_grad()
    def load_frozen_tables(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        register_frozen_tables(self, embed_weight, lm_head_weight, (self.args.vocab_size, self.args.hidden_size),
                               self.fc.weight)
        if self._head_from_target:  # only right after init_weights, never over trained weights
            self.lm_head.weight.copy_(self.target_lm_head[self.draft_ids()].to(self.lm_head.weight.dtype))
            self._head_from_target = False

    def set_train_progress(self, step: int, total_steps: int) -> None:
        pass

    # ----- pieces shared by training and decoding -----

    def draft_ids(self) -> torch.Tensor:
        """``[Vd]`` target id of every draft-vocabulary entry."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        a = self.args
        return rope_cos_sin(positions, a.head_dim, a.rope_theta, dtype)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """``[B, S, K*H]`` capture-layer outputs -> the step-0 hidden input ``[B, S, H]``."""
        if not isinstance(self.fc.weight, DTensor):
            aux = aux.to(self.fc.weight.dtype)
        return self.fc(aux)

    def embed(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return F.embedding(token_ids, self.target_embed).to(dtype)

    def forward(self, features, *, generator: torch.Generator | None = None):
        from models.eagle3.objective import ttt_objective

        return ttt_objective(self, features)
