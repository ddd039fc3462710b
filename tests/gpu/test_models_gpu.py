"""GPU checks of the model code: compiled flex vs sdpa (forward and gradients), bf16 compute,
chunked-CE memory. Skipped without CUDA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.common import chunked_cross_entropy
from models.dflash2 import DFlash2Draft, dflash2_flavors
from models.block_diffusion.layers import sample_anchors
from models.targets.qwen3 import Qwen3Model, qwen3_flavors
from titan_draft.protocols.features import TargetFeatures

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ARGS = replace(
    dflash2_flavors["debugmodel"],
    vocab_size=1024,
    mask_token_id=1000,
    target_layer_ids=[1, 3],
    num_target_layers=6,
    num_anchors=24,
    static_anchors=True,
    ce_chunk_rows=64,
)


def _setup(dtype, backend, compile_blocks=False):
    dev = torch.device("cuda")
    targs = replace(qwen3_flavors["debugmodel"], vocab_size=ARGS.vocab_size)
    target = Qwen3Model(targs).to(dev)
    target.init_weights(0)
    torch.manual_seed(0)
    model = DFlash2Draft(replace(ARGS, attn_backend=backend)).to(dev)
    model.init_weights()
    with torch.no_grad():  # non-trivial conv and selector
        for name, p in model.named_parameters():
            if "kernel_projection" in name or "successor" in name:
                p.normal_(std=0.05)
    model.to(dtype)
    model.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    if compile_blocks:
        for layer in model.layers.values():
            layer.compile()
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, 1000, (2, 160), device=dev, generator=g)
    loss_mask = torch.ones_like(ids, dtype=torch.bool)
    loss_mask[:, :20] = False
    valid = torch.tensor([160, 100], device=dev)
    aux, _ = target.capture(ids, ARGS.target_layer_ids, need_last_hidden=False)
    return model, TargetFeatures(ids, loss_mask, valid, aux)


def test_flex_compiled_matches_sdpa_forward_and_grads():
    outs = []
    for backend, compile_blocks in (("sdpa", False), ("flex", True)):
        model, f = _setup(torch.float32, backend, compile_blocks)
        anchors, keep = sample_anchors(
            f.loss_mask, f.valid_lengths, ARGS.num_anchors, True, torch.Generator().manual_seed(1)
        )
        out = model.forward_with_anchors(f, anchors, keep)
        out.loss_sum.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        outs.append((out, grads))
    (o1, g1), (o2, g2) = outs
    torch.testing.assert_close(o1.loss_sum, o2.loss_sum, rtol=2e-3, atol=1e-3)
    for k in o1.metrics:
        torch.testing.assert_close(o1.metrics[k][1], o2.metrics[k][1])
    for n in g1:
        torch.testing.assert_close(g1[n], g2[n], rtol=2e-2, atol=2e-3, msg=n)


def test_bf16_flex_train_step_finite():
    model, f = _setup(torch.bfloat16, "auto", compile_blocks=True)
    out = model(f, generator=torch.Generator().manual_seed(0))
    out.loss_sum.backward()
    assert out.loss_sum.dtype == torch.float32 and torch.isfinite(out.loss_sum)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.layers["0"].self_attn.q_proj.weight.grad.dtype == torch.bfloat16


def test_chunked_ce_peak_memory_below_full_logits():
    n, h, v = 8192, 1024, 151936
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(v, h, device="cuda", dtype=torch.bfloat16) * 0.02
    labels = torch.randint(0, v, (n,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = chunked_cross_entropy(hidden, weight, labels, chunk_rows=1024, top_k=16)
    (out.ce.sum() + out.topk_values.sum()).backward()
    peak = torch.cuda.max_memory_allocated() - base
    full_logits_fp32 = n * v * 4
    assert peak < 0.5 * full_logits_fp32, (peak, full_logits_fp32)


@pytest.mark.parametrize("topk_group", [0, 128])
@pytest.mark.parametrize("scale,cap", [(1.0, 0.0), (1.5, 20.0)])
def test_compiled_chunked_ce_matches_float64_reference(scale, cap, topk_group):
    """The CUDA path (compiled chunk statistics, top-k on bf16 logits, gradient formed in
    forward) against a float64 CPU reference on the same bf16 values."""
    # A training run compiles the chunk statistics for one scale/softcap and at most two chunk
    # sizes; this file's cases together compile more graphs than dynamo's recompile limit (8),
    # which fullgraph=True turns into an error (seen on the H200, 2026-12-02): start clean.
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    n, h, v, k = 300, 64, 5120, 8
    hidden = (torch.randn(n, h, generator=g) * 2).bfloat16()
    weight = (torch.randn(v, h, generator=g) * 0.5).bfloat16()
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = -100
    g_ce, g_top = torch.rand(n, generator=g), torch.randn(n, k, generator=g)

    h1 = hidden.cuda().requires_grad_(True)
    out = chunked_cross_entropy(h1, weight.cuda(), labels.cuda(), chunk_rows=128, top_k=k,
                                topk_group=topk_group, logit_scale=scale, softcap=cap)
    ((out.ce * g_ce.cuda()).sum() + (out.topk_values * g_top.cuda()).sum()).backward()

    h2 = hidden.double().requires_grad_(True)
    exact = h2 @ weight.double().t()
    z = exact.detach().bfloat16().double() + (exact - exact.detach())  # bf16 value, exact gradient
    u = z * scale
    if cap:
        u = cap * torch.tanh(u / cap)
    ce = torch.nn.functional.cross_entropy(u, labels, reduction="none", ignore_index=-100)
    topv = u.gather(1, out.topk_indices.cpu())
    ((ce * g_ce.double()).sum() + (topv * g_top.double()).sum()).backward()

    torch.testing.assert_close(out.ce.cpu().double(), ce.detach(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.topk_values.cpu().double(), topv.detach(), rtol=1e-4, atol=1e-4)
    # cuBLAS may round a logit to the neighbouring bf16 value (an ulp is 0.125 at 16..32), which
    # can swap near-ties: the chosen logits must be the top-k values up to that
    ref_top = u.detach().topk(k, dim=-1).values
    torch.testing.assert_close(u.detach().gather(1, out.topk_indices.cpu()), ref_top, rtol=0, atol=0.3)
    assert (out.topk_indices.cpu() == u.detach().topk(k, dim=-1).indices).float().mean() > 0.9
    assert (out.argmax.cpu() == u.detach().argmax(-1)).float().mean() > 0.95  # near-ties aside
    # the gradient comes back in bf16 (hidden's dtype): steps of 1/128 at |g| ~ 2-4
    torch.testing.assert_close(h1.grad.cpu().double(), h2.grad, rtol=2e-2, atol=2e-2)


def test_compiled_target_capture_matches_eager_in_bf16():
    """compile.target on CUDA in bf16 (GQA, causal sdpa): one graph for every layer, the eager
    capture's features within bf16 rounding, and decoding (cache path) still eager."""
    from torch._dynamo.utils import counters

    dev = torch.device("cuda")
    targs = replace(qwen3_flavors["debugmodel"], vocab_size=1024)
    eager = Qwen3Model(targs).to(dev)
    eager.init_weights(0)
    eager.to(torch.bfloat16).requires_grad_(False)
    compiled = Qwen3Model(targs).to(dev)
    compiled.load_state_dict(eager.state_dict())
    compiled.to(torch.bfloat16).requires_grad_(False)
    torch._dynamo.reset()
    counters.clear()
    compiled.compile_capture("inductor")
    ids = torch.randint(0, 1024, (4, 256), device=dev, generator=torch.Generator(dev).manual_seed(0))
    with torch.no_grad():
        aux, last = compiled.capture(ids, [1, 3], need_last_hidden=True)
        want_aux, want_last = eager.capture(ids, [1, 3], need_last_hidden=True)
        step = compiled(ids[:, :8], [1], False, cache=compiled.new_cache(4, 16), logits="last")
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(aux.float(), want_aux.float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(last.float(), want_last.float(), rtol=0.05, atol=0.05)
    assert step.logits.isfinite().all()


def test_dspark_teacher_spans_started_ahead_match_the_synced_ones():
    """The spans DSpark starts before its layers (pinned copy behind an event) are the ones the
    synced path reads, also when the device is still busy with earlier work."""
    from models.dspark.loss import start_teacher_spans, teacher_spans

    g = torch.Generator(device="cuda").manual_seed(0)
    idx = torch.randint(0, 4096, (3584,), device="cuda", generator=g).sort().values
    weight = (torch.rand(3584, device="cuda", generator=g) > 0.3).float()
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # queue work ahead of the spans
        busy = busy @ busy / 64
    started = start_teacher_spans(idx, weight, 512)
    assert started() == teacher_spans(idx, weight, 512)
    assert len(started()) == 7
