"""On CUDA, bf16 and fp32: families only target.backend = "transformers" runs (Mistral's sliding
window, Gemma2's soft-capping and alternating window) capture what transformers' own forward
computes, and a draft trains two steps against them. Skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import debug_job_argv
from hf_folders import HF_ONLY_FAMILIES, write_hf_only_chat_target, write_hf_only_target

from titan_draft.config import ConfigManager
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.features.target import load_target
from titan_draft.train import Trainer

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYERS = [0, 1]  # of 3: HF hidden_states of the last layer is after the final norm
# relative error norm: fp32 without TF32 differs from the eager fp32 reference by kernel order only;
# bf16 rounds every layer (about 3% at the last of 3 layers of these widened random weights on CPU)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2}


@pytest.fixture(scope="module", params=sorted(HF_ONLY_FAMILIES))
def folder(request, tmp_path_factory):
    return write_hf_only_target(tmp_path_factory.mktemp(request.param), request.param)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_capture_and_logits_equal_transformers_on_cuda(folder, dtype):
    """The reference is transformers' eager forward in fp32 on the same device (the only kernel
    that applies Gemma2's attention soft-capping); windows of 8 tokens, rows of 48."""
    ids = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(7)).cuda()
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                            attn_implementation="eager").cuda()
    with torch.no_grad():
        out = ref(ids, output_hidden_states=True)
        want_last = ref.get_decoder()(ids).last_hidden_state
    model = load_target(folder, dtype=dtype, device="cuda", backend="transformers")
    assert model.embed_weight().device.type == "cuda" and model.embed_weight().dtype == dtype
    aux, last = model.capture(ids, LAYERS)
    with torch.no_grad():
        logits = model(ids)
    tol = TOLERANCE[dtype]
    h = model.args.hidden_size
    for k, i in enumerate(LAYERS):
        assert _rel_err(aux[..., k * h:(k + 1) * h], out.hidden_states[i + 1]) < tol, (i, dtype)
    assert _rel_err(last, want_last) < tol
    assert _rel_err(logits, out.logits) < tol
    cap = getattr(ref.config, "final_logit_softcapping", None)
    if cap:
        assert float(logits.float().abs().max()) <= cap
    # decoding: a cached prefill then one block gives the uncached forward's logits
    cache = model.new_cache(2, 48)
    with torch.no_grad():
        model(ids[:, :40], None, False, cache=cache, logits="none")
        step = model(ids[:, 40:48], None, False, cache=cache, logits="all")
    assert _rel_err(step.logits, logits[:, 40:48].float()) < tol


@pytest.mark.parametrize("target_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(HF_ONLY_FAMILIES))
def test_dflash2_trains_two_steps_against_the_backend_on_cuda(tmp_path, chat_jsonl, family, target_dtype):
    folder = write_hf_only_chat_target(tmp_path / family, family)
    argv = debug_job_argv("dflash2", tmp_path / "run", folder, chat_jsonl, "--target.backend", "transformers",
                          "--target.dtype", target_dtype, "--data.max_rows", "0",
                          "--training.local_batch_size", "2", "--training.steps", "2",
                          "--checkpoint.enable", "false", max_length=64)
    trainer = Trainer(ConfigManager().parse_args(argv))
    try:
        assert trainer.device.type == "cuda" and trainer.target.family == "transformers"
        assert next(trainer.target.model.parameters()).dtype == getattr(torch, target_dtype)
        losses = trainer.train()
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses.values())
    finally:
        trainer.close()
        destroy_distributed()
