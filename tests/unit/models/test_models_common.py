"""models/common: chunked cross-entropy, RMSNorm, RoPE, attention backends."""

from __future__ import annotations

import math

import pytest
import torch

from models.common import (
    RMSNorm,
    apply_rope,
    attention,
    build_attention_mask,
    chunked_cross_entropy,
    dense_mask_from_mask_mod,
    rope_cos_sin,
)
from torch.nn.attention.flex_attention import BlockMask, create_mask


def _reference_ce(hidden, weight, labels, top_k, scale, cap):
    z = hidden @ weight.t() * scale
    if cap > 0:
        z = cap * torch.tanh(z / cap)
    logp = torch.log_softmax(z, dim=-1)
    ce = -logp.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    ce = torch.where(labels >= 0, ce, torch.zeros_like(ce))
    topv, topi = z.topk(top_k, dim=-1) if top_k else (z[:, :0], labels[:, None][:, :0])
    return ce, z.argmax(-1), topv, topi


@pytest.mark.parametrize("topk_group", [0, 5])
@pytest.mark.parametrize("scale,cap", [(1.0, 0.0), (1.7, 3.0)])
def test_chunked_ce_matches_unchunked_values_and_grads(scale, cap, topk_group):
    g = torch.Generator().manual_seed(0)
    n, h, v, k = 37, 12, 50, 5
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[3] = -100  # ignored row
    g_ce = torch.randn(n, generator=g, dtype=torch.float64)
    g_top = torch.randn(n, k, generator=g, dtype=torch.float64)

    h1 = hidden.clone().requires_grad_(True)
    out = chunked_cross_entropy(
        h1, weight, labels, chunk_rows=8, top_k=k, topk_group=topk_group, logit_scale=scale, softcap=cap
    )
    ((out.ce * g_ce).sum() + (out.topk_values * g_top).sum()).backward()

    h2 = hidden.clone().requires_grad_(True)
    ce, am, topv, topi = _reference_ce(h2, weight, labels, k, scale, cap)
    ((ce * g_ce).sum() + (topv * g_top).sum()).backward()

    assert out.ce.dtype == torch.float64
    torch.testing.assert_close(out.ce, ce.detach(), rtol=1e-12, atol=1e-12)
    assert out.ce[3] == 0
    assert torch.equal(out.argmax, am)
    assert torch.equal(out.topk_indices, topi)
    torch.testing.assert_close(out.topk_values, topv.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("scale,cap", [(1.0, 0.0), (1.7, 3.0)])
def test_chunk_stats_compiled_form_equals_the_eager_one(scale, cap):
    """CUDA compiles the per-chunk statistics (a fused softmax - onehot); eager (CPU) scatters the
    labels' -1 in place. Both against float64 log_softmax's gradient, ignored rows included."""
    from models.common.cross_entropy import _chunk_stats

    g = torch.Generator().manual_seed(2)
    z = torch.randn(9, 40, generator=g, dtype=torch.float64).requires_grad_(True)
    labels = torch.randint(0, 40, (9,), generator=g)
    labels[[2, 7]] = -100
    u = z * scale
    u = cap * torch.tanh(u / cap) if cap > 0 else u
    ce_ref = -torch.log_softmax(u, -1).gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * (labels >= 0)
    (grad_ref,) = torch.autograd.grad(ce_ref.sum(), z)
    compiled = torch.compile(_chunk_stats, backend="aot_eager", fullgraph=True, dynamic=False)
    for stats in (_chunk_stats, compiled):
        ce, argmax, grad = stats(z.detach(), labels, scale, cap, True)
        torch.testing.assert_close(ce, ce_ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)
        assert torch.equal(argmax, u.argmax(-1)) and grad[2].abs().sum() == 0


def test_chunked_ce_ce_only_grad_and_fp32_output():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(10, 8, generator=g, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(30, 8, generator=g, dtype=torch.bfloat16)
    labels = torch.randint(0, 30, (10,), generator=g)
    out = chunked_cross_entropy(hidden, weight, labels, chunk_rows=3)
    assert out.ce.dtype == torch.float32 and out.topk_values.shape == (10, 0)
    out.ce.sum().backward()
    ref = torch.nn.functional.cross_entropy(
        (hidden.detach() @ weight.t()).float(), labels, reduction="none"
    )
    torch.testing.assert_close(out.ce, ref, rtol=1e-5, atol=1e-5)
    assert hidden.grad.dtype == torch.bfloat16 and hidden.grad.abs().sum() > 0


def test_chunked_ce_saves_no_full_logits_and_rejects_trainable_weight():
    n, v = 16, 64
    hidden = torch.randn(n, 8, requires_grad=True)
    weight = torch.randn(v, 8)
    saved: list[torch.Size] = []

    def pack(t):
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_cross_entropy(
            hidden, weight, torch.zeros(n, dtype=torch.long), chunk_rows=4, top_k=3
        )
    assert saved, "expected the autograd function to save its inputs"
    assert all(math.prod(s) < n * v for s in saved if s != weight.shape), saved
    with pytest.raises(ValueError, match="frozen"):
        chunked_cross_entropy(hidden, weight.requires_grad_(True), torch.zeros(n, dtype=torch.long))


def test_rmsnorm_and_rope_reference():
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    norm = RMSNorm(8, eps=1e-6).double()
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), ref)

    # RoPE: pairs (i, i + D/2) rotate by angle pos * theta^(-2i/D)
    d, theta = 8, 10000.0
    q = torch.randn(2, 1, 3, d, dtype=torch.float64)
    pos = torch.tensor([[0, 5, 17], [3, 3, 100]])
    cos, sin = rope_cos_sin(pos, d, theta)
    out = apply_rope(q, cos.double(), sin.double())
    for b in range(2):
        for t in range(3):
            for i in range(d // 2):
                ang = pos[b, t].item() * theta ** (-2 * i / d)
                x1, x2 = q[b, 0, t, i].item(), q[b, 0, t, i + d // 2].item()
                assert math.isclose(
                    out[b, 0, t, i].item(), x1 * math.cos(ang) - x2 * math.sin(ang), abs_tol=1e-5
                )
                assert math.isclose(
                    out[b, 0, t, i + d // 2].item(),
                    x2 * math.cos(ang) + x1 * math.sin(ang),
                    abs_tol=1e-5,
                )


def test_dense_mask_equals_torch_create_mask_and_backends_agree():
    lengths = torch.tensor([5, 9])

    def mask_mod(b, h, q, kv):
        return (kv <= q) & (kv < lengths[b])

    dense = dense_mask_from_mask_mod(mask_mod, 2, 7, 11, "cpu")
    assert dense.shape == (2, 1, 7, 11)
    assert torch.equal(dense, create_mask(mask_mod, 2, 1, 7, 11, device="cpu"))
    assert isinstance(build_attention_mask(mask_mod, 2, 7, 11, "cpu", "flex"), BlockMask)
    assert isinstance(build_attention_mask(mask_mod, 2, 7, 11, "cpu", "auto"), torch.Tensor)

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 7, 8, generator=g)
    k = torch.randn(2, 2, 11, 8, generator=g)
    v = torch.randn(2, 2, 11, 8, generator=g)
    o_sdpa = attention(q, k, v, build_attention_mask(mask_mod, 2, 7, 11, "cpu", "sdpa"))
    o_flex = attention(q, k, v, build_attention_mask(mask_mod, 2, 7, 11, "cpu", "flex"))
    torch.testing.assert_close(o_sdpa, o_flex, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="attn_backend"):
        build_attention_mask(mask_mod, 2, 7, 11, "cpu", "xformers")


def test_chunked_ce_backward_does_not_recompute_logits():
    """The CE gradient is formed in forward; backward must not run the [N, V] matmul again
    (it is the most expensive op of a DFlash step after the draft's own linears)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    n, h, v = 12, 8, 40

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.vocab_wide = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.matmul, torch.ops.aten.bmm) \
                    and isinstance(out, torch.Tensor) and out.shape[-1] == v:
                self.vocab_wide += 1
            return out

    hidden = torch.randn(n, h, requires_grad=True)
    out = chunked_cross_entropy(hidden, torch.randn(v, h), torch.randint(0, v, (n,)), chunk_rows=5, top_k=3)
    loss = out.ce.sum() + out.topk_values.sum()
    with CountMatmuls() as counter:
        loss.backward()
    assert counter.vocab_wide == 0 and hidden.grad.abs().sum() > 0
    with torch.no_grad(), CountMatmuls() as counter:  # no gradient wanted: logits once per chunk
        chunked_cross_entropy(hidden, torch.randn(v, h), torch.randint(0, v, (n,)), chunk_rows=5)
    assert counter.vocab_wide == 3


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_topk_by_group_max_equals_torch_topk(dtype):
    """The two-pass top-k returns torch.topk's values, descending, at distinct indices holding
    them: on random rows, on rows with many ties (small integers), and when the top-k sit in
    few groups or one per group."""
    from models.common.cross_entropy import topk_by_group_max

    g = torch.Generator().manual_seed(0)
    width, k = 1200, 16
    spread = torch.full((3, width), -1.0)
    spread[:, torch.arange(k) * 75 + 3] = torch.arange(k, dtype=torch.float32) + 1  # one per group
    packed = torch.full((3, width), -1.0)
    packed[:, 600:600 + k] = torch.arange(k, dtype=torch.float32) + 1  # all in one or two groups
    cases = [torch.randn(9, width, generator=g), torch.randint(-3, 4, (9, width), generator=g).float(),
             spread, packed]
    for z in cases:
        z = z.to(dtype)
        for group in (50, 64, 75):
            top, idx = topk_by_group_max(z, k, group)
            ref = z.topk(k, dim=-1).values
            assert torch.equal(top, ref), group
            assert torch.equal(z.gather(1, idx), ref)
            assert all(len(set(row.tolist())) == k for row in idx)
    z = torch.randn(4, width, generator=g, dtype=torch.float64)
    assert torch.equal(topk_by_group_max(z, k, 75)[1], z.topk(k).indices)  # no ties: same indices
    # not a multiple of the group, or fewer groups than k: one plain topk
    for group in (7, 100):
        assert torch.equal(topk_by_group_max(z, k, group)[1], z.topk(k).indices)
    with pytest.raises(ValueError, match="topk_group"):
        chunked_cross_entropy(z[:, :8], torch.randn(10, 8, dtype=torch.float64), torch.zeros(4, dtype=torch.long),
                              top_k=2, topk_group=-1)



@pytest.mark.parametrize("scale,cap", [(1.0, 0.0), (1.7, 3.0)])
def test_chunked_ce_against_the_targets_distribution(scale, cap):
    """``teacher``: each row's CE against softmax of the target's logits through the same head
    and transform, gradient included; ignored rows get 0; the target's probabilities of the
    top-k ids; the compiled per-chunk form equals the eager one."""
    from models.common.cross_entropy import _soft_chunk_stats

    g = torch.Generator().manual_seed(4)
    n, h, v = 23, 10, 40
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    teacher = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[[4, 11]] = -100
    g_ce = torch.randn(n, generator=g, dtype=torch.float64)

    def transform(z):
        z = z * scale
        return cap * torch.tanh(z / cap) if cap > 0 else z

    h2 = hidden.clone().requires_grad_(True)
    pt = torch.softmax(transform(teacher @ weight.t()), -1)
    ref = -(pt * torch.log_softmax(transform(h2 @ weight.t()), -1)).sum(-1) * (labels >= 0)
    (ref * g_ce).sum().backward()
    for chunk in (5, 64):
        h1 = hidden.clone().requires_grad_(True)
        out = chunked_cross_entropy(h1, weight, labels, chunk_rows=chunk, top_k=3, logit_scale=scale, softcap=cap,
                                    teacher=teacher)
        (out.ce * g_ce).sum().backward()
        torch.testing.assert_close(out.ce, ref.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-10, atol=1e-12)
        assert out.ce[4] == 0 and torch.equal(out.argmax, transform(hidden @ weight.t()).argmax(-1))
        # the target's probability of each of the draft's top-3 ids
        torch.testing.assert_close(out.teacher_topk, pt.gather(1, out.topk_indices), rtol=1e-12, atol=1e-15)
    # not the label's CE: the two differ on these rows
    hard = chunked_cross_entropy(hidden, weight, labels, chunk_rows=64, logit_scale=scale, softcap=cap)
    assert (hard.ce - out.ce).abs().max() > 0.1
    z, zt = hidden @ weight.t(), teacher @ weight.t()
    compiled = torch.compile(_soft_chunk_stats, backend="aot_eager", fullgraph=True, dynamic=False)
    eager = _soft_chunk_stats(z, zt, labels, scale, cap, True)
    for a, b in zip(eager, compiled(z, zt, labels, scale, cap, True)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="teacher"):
        chunked_cross_entropy(hidden, weight, labels, teacher=teacher[:3])
