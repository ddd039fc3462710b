"""EAGLE-3's training-time test: the midlayer unrolled ``ttt_steps`` times, its mask and its loss.

Step i at position t: token x_{t+1+i} (teacher-forced), hidden = step i - 1's pre-norm output at
t (the fused features g_t for step 0), RoPE position t + i; it predicts x_{t+2+i} against the
target's next-token distribution at position t + 1 + i, restricted to the draft vocabulary and
renormalized. A position is supervised at step i when x_{t+2+i} is a loss token inside the
sequence and the target's own argmax there is in the draft vocabulary.

Loss: ``sum_i decay**i * sum_t mask_i(t) * CE(p_i(t), q_i(t))`` (``soft_labels = false``: q a
one-hot of the target's argmax), normalized by the number of step-0 supervised positions (the
trainer divides by it, reduced over micro-batches and ranks).
Metrics: per-step accuracy (draft argmax = target argmax) and the simulated acceptance length
``1 + sum_k prod_{i <= k} correct_i`` at each step-0 supervised position.

Packed rows (``TargetFeatures.document_ids``): a position's document ``[start, end)`` bounds
everything. Step 0 attends to ``start <= s <= t`` (the padding tail is a document of its own,
so no row is empty), RoPE positions restart at each document, ``x_{t+2+i}`` is a target only
while ``t + 2 + i < end``, and the tokens fed past a document's end (to positions no loss
reads) are its last token, never the next document's.
"""

from __future__ import annotations

import torch

from models.common import build_attention_mask, resolve_attention_backend
from models.common.lazy_compile import LazyCompiled
from models.eagle3.block_mask import ttt_block_mask
from models.eagle3.ttt_attention import build_diagonal_past, diagonal_slots
from titan_draft.protocols.features import DraftOutput, TargetFeatures


def ttt_mask_mod(seq_len: int, valid_lengths: torch.Tensor, starts: torch.Tensor | None = None):
    """flex ``mask_mod`` of any step over ``KV_LEN = (i + 1) * S`` keys (step j's keys at
    ``j * S + s``): step 0's keys causally (``s <= t``, inside the sequence), the later steps'
    keys only at the query's own position (the chain the query is part of). Packed rows
    (``starts [B, S]``, each position's document start): step 0's keys causally inside the
    query's document, ``starts[t] <= s <= t``."""

    def mask_mod(b, h, q_idx, kv_idx):
        j = kv_idx // seq_len
        s = kv_idx - j * seq_len
        if starts is None:
            causal = (j == 0) & (s <= q_idx) & (s < valid_lengths[b])
        else:
            causal = (j == 0) & (s <= q_idx) & (s >= starts[b, q_idx])
        return causal | ((j >= 1) & (s == q_idx))

    return mask_mod


def _shift_in_documents(x: torch.Tensor, k: int, ends: torch.Tensor) -> torch.Tensor:
    """``y[:, t] = x[:, t + k]`` while ``t + k`` is in ``t``'s document, else its last token
    (a padding position reads itself)."""
    pos = torch.arange(x.shape[1], device=x.device)
    idx = torch.minimum(pos + k, torch.where(ends > pos, ends - 1, pos))
    return x.gather(1, idx)


def _shift(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """``y[:, t] = x[:, t + k]`` (``fill`` past the end)."""
    if k == 0:
        return x
    pad = x.new_full((x.shape[0], k, *x.shape[2:]), fill)
    return torch.cat([x[:, k:], pad], dim=1)[:, : x.shape[1]]


@torch.no_grad()
def teacher(draft, last_hidden: torch.Tensor, chunk_rows: int = 2048, pad: int = 0, soft: bool = True):
    """The target's next-token distribution at every position, restricted to the draft vocabulary:
    ``(p [B, S + pad, Vd] (fp32, fp64 for fp64 tables; the last ``pad`` positions are 0),
    in_vocab [B, S] bool (its full-vocabulary argmax is a draft token), argmax [B, S] (draft
    index))``, from the final-norm hidden through the frozen lm_head, chunked within each sample:
    no ``[B * S, V]`` logits are ever alive at once. The padding lets TTT step i read
    ``p[:, 1 + i : 1 + i + S]`` as a view, where a shifted copy would be one more ``[B, S, Vd]``
    fp32 tensor per step, each kept for backward. ``soft=False``: ``p`` holds a one-hot of the
    argmax instead of the distribution (``soft_labels = false``)."""
    bsz, seq, _ = last_hidden.shape
    w, ids = draft.target_lm_head, draft.draft_ids()
    acc_dtype = torch.promote_types(w.dtype, torch.float32)
    p = last_hidden.new_empty(bsz, seq + pad, ids.numel(), dtype=acc_dtype)
    p[:, seq:].zero_()  # every other position is written below
    in_vocab = torch.empty(bsz, seq, dtype=torch.bool, device=last_hidden.device)
    arg = torch.empty(bsz, seq, dtype=torch.long, device=last_hidden.device)
    for b in range(bsz):
        for s in range(0, seq, chunk_rows):
            e = min(s + chunk_rows, seq)
            z = last_hidden[b, s:e].to(w.dtype) @ w.t()
            in_vocab[b, s:e] = draft.t2d[z.argmax(dim=-1)]
            zd = z[:, ids].to(acc_dtype)
            arg[b, s:e] = zd.argmax(dim=-1)
            if soft:
                p[b, s:e] = torch.softmax(zd, dim=-1)
            else:  # the argmax alone; positions where it is no draft token train nothing
                p[b, s:e].zero_().scatter_(-1, arg[b, s:e, None], 1.0)
    return p, in_vocab, arg


def _step_terms(logits: torch.Tensor, p: torch.Tensor, gold: torch.Tensor):
    """One TTT step's per-position soft CE ``-sum_v p_v log softmax(logits)_v`` (in the wider of
    the two dtypes; ``p`` is at least fp32) and whether the draft's argmax is the target's
    (``gold``)."""
    acc = torch.promote_types(logits.dtype, p.dtype)
    ce = -(p.to(acc) * torch.log_softmax(logits.to(acc), dim=-1)).sum(dim=-1)
    return ce, logits.argmax(dim=-1) == gold


# On CUDA the step's vocabulary-wide terms run compiled: forward and backward each become one
# pass over the [B, S, Vd] logits and the teacher's rows, where the eager cast, log_softmax,
# product, sum and argmax (and their backward) are ~10 fp32 passes a step -- at 2 x 2048 x 32000
# and 7 steps, ~35 % of the H200 profile's non-matmul time (2026-12-02). Every step has the same
# shapes and strides (the teacher's rows are views one row apart), so one graph serves all 7.
_compiled_step_terms = LazyCompiled(_step_terms, fullgraph=True, dynamic=False)


def ttt_objective(draft, f: TargetFeatures) -> DraftOutput:
    a = draft.args
    if f.last_hidden is None:
        raise ValueError("EAGLE-3 needs the target's final-norm hidden states (needs_last_hidden)")
    if draft.target_lm_head.shape[0] == 0:
        raise RuntimeError("Eagle3Draft: call load_frozen_tables() before forward")
    bsz, seq = f.input_ids.shape
    device = f.input_ids.device
    hidden = draft.fuse(f.aux_hidden)
    dtype = hidden.dtype
    acc_dtype = torch.promote_types(dtype, torch.float32)
    p, in_vocab, gold = teacher(draft, f.last_hidden, pad=a.ttt_steps, soft=a.soft_labels)
    positions = torch.arange(seq, device=device).expand(bsz, seq)
    lengths = f.valid_lengths.to(device)
    packed = f.document_ids is not None
    if packed:
        starts, valid = f.document_spans()  # valid: each position's document end
        rope_positions = f.position_ids().expand(bsz, seq)
    else:
        starts, valid, rope_positions = None, lengths[:, None], positions
    mask_mod = ttt_mask_mod(seq, lengths, starts)
    # flex: each step's BlockMask from its tile structure (no dense [B, Q, KV] evaluation of the
    # mask_mod, which is still what flex applies inside the partial tiles); sdpa: the dense mask.
    flex = resolve_attention_backend(a.attn_backend, device) == "flex"
    diagonal = a.ttt_attention == "diagonal"
    loss_sum = torch.zeros((), device=device, dtype=acc_dtype)
    metrics: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    chain = torch.ones(bsz, seq, device=device, dtype=acc_dtype)
    accepted = torch.zeros(bsz, seq, device=device, dtype=acc_dtype)
    past: list = []
    m0 = None
    step_terms = _compiled_step_terms if device.type == "cuda" else _step_terms
    for i in range(a.ttt_steps):
        tokens = _shift_in_documents(f.input_ids, 1 + i, valid) if packed else _shift(f.input_ids, 1 + i)
        rope = draft.rope(rope_positions + i, acc_dtype)
        if i == 0 or not diagonal:  # the diagonal form keeps step 0's mask
            if flex:
                attn_mask = ttt_block_mask(seq, lengths, i, mask_mod=mask_mod, starts=starts)
            else:
                attn_mask = build_attention_mask(mask_mod, bsz, seq, (i + 1) * seq, device, a.attn_backend)
        attend = build_diagonal_past(past, diagonal_slots(a.ttt_steps)) if diagonal and i > 0 else past
        out, kv = draft.midlayer(draft.embed(tokens, dtype), hidden, rope, attend, attn_mask)
        past.append(kv)
        logits = draft.lm_head(draft.norm(out))
        m = ((positions + 2 + i < valid) & _shift(f.loss_mask.bool(), 2 + i, False)
             & _shift(in_vocab, 1 + i, False)).to(acc_dtype)
        ce, hit = step_terms(logits, p[:, 1 + i : 1 + i + seq], _shift(gold, 1 + i))
        loss_sum = loss_sum + a.step_decay**i * (m * ce).sum()
        correct = hit.to(acc_dtype)
        metrics[f"acc_{i}"] = ((m * correct).sum(), m.sum())
        if i == 0:
            m0 = m
            metrics["ce"] = ((m * ce).sum(), m.sum())
            metrics["acc"] = metrics["acc_0"]
        chain = chain * correct * m
        accepted = accepted + chain
        hidden = out
    metrics["accept_len"] = ((m0 * (1.0 + accepted)).sum(), m0.sum())
    metrics = {k: (num.detach(), den.detach()) for k, (num, den) in metrics.items()}
    return DraftOutput(loss_sum=loss_sum, loss_denominator=m0.sum().detach(), metrics=metrics)
