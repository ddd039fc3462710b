"""On CUDA: EAGLE-3's diagonal TTT attention (flex with its log-sum-exp, the layer compiled in place
as the trainer compiles it) against the concat form, loss and gradients, padded and packed rows
of 2 x 1024 tokens; and its layer traced twice, not once per step. Skipped without CUDA."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from models.eagle3 import Eagle3Draft, eagle3_flavors
from titan_draft.protocols import TargetFeatures

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

V, VD, S = 4096, 1024, 1024


def _draft(form: str, dtype: torch.dtype) -> Eagle3Draft:
    args = replace(eagle3_flavors["smollm2"], vocab_size=V, draft_vocab_size=VD, ttt_steps=7,
                   target_layer_ids=[1, 14, 26], num_target_layers=30, ttt_attention=form)
    torch.manual_seed(0)
    with torch.device("cuda"):
        d = Eagle3Draft(args)
    d.init_weights()
    with torch.no_grad():
        d.d2t.copy_(torch.arange(0, 4 * VD, 4, device="cuda") - torch.arange(VD, device="cuda"))
        d.t2d.zero_()
        d.t2d[d.draft_ids()] = True
    g = torch.Generator("cuda").manual_seed(1)
    h = args.hidden_size
    d.load_frozen_tables(torch.randn(V, h, device="cuda", generator=g), torch.randn(V, h, device="cuda", generator=g))
    return d.to(dtype)


def _features(packed: bool, h: int, dtype: torch.dtype) -> TargetFeatures:
    g = torch.Generator("cuda").manual_seed(2)
    docs = None
    if packed:  # documents of 300, 500 and 200 tokens, then 24 of padding
        one = torch.repeat_interleave(torch.arange(4, device="cuda"), torch.tensor([300, 500, 200, 24], device="cuda"))
        docs = torch.stack([one, one]).to(torch.int32)
    return TargetFeatures(input_ids=torch.randint(0, V, (2, S), device="cuda", generator=g),
                          loss_mask=torch.rand(2, S, device="cuda", generator=g) > 0.3,
                          valid_lengths=torch.tensor([1000, 1000] if packed else [S, 700], device="cuda"),
                          aux_hidden=torch.randn(2, S, 3 * h, device="cuda", generator=g).to(dtype),
                          last_hidden=(torch.randn(2, S, h, device="cuda", generator=g) * 2).to(dtype),
                          document_ids=docs)


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_compiled_diagonal_equals_concat_on_cuda(packed):
    results = []
    for form in ("concat", "diagonal"):
        torch._dynamo.reset()
        d = _draft(form, torch.float32)
        d.midlayer.compile()
        f = _features(packed, d.args.hidden_size, torch.float32)
        out = d(f)
        params = [p for p in d.parameters() if p.requires_grad]
        results.append((out.loss_sum.detach(), torch.autograd.grad(out.loss_sum, params)))
    (loss_c, grads_c), (loss_d, grads_d) = results
    torch.testing.assert_close(loss_d, loss_c, rtol=1e-4, atol=1e-4)
    for gc, gd in zip(grads_c, grads_d):  # fp32, two summation orders: compared as whole tensors
        assert ((gd - gc).norm() / gc.norm()).item() < 1e-4
    torch._dynamo.reset()


def test_the_diagonal_layer_is_traced_twice_in_bf16():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    d = _draft("diagonal", torch.bfloat16)
    counter = CompileCounterWithBackend("inductor")
    d.midlayer.compile(backend=counter)
    d(_features(False, d.args.hidden_size, torch.bfloat16)).loss_sum.backward()
    assert counter.frame_count == 2
    torch._dynamo.reset()
