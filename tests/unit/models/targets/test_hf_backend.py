"""target.backend = "transformers": families with no native code (Gemma2's soft-capping, Mistral's
sliding window) capture and decode exactly what transformers' own forward computes."""

from __future__ import annotations

import pytest
import torch
from hf_folders import HF_ONLY_FAMILIES, write_hf_only_target

from titan_draft.features.target import load_target

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3))
LAYERS = [1, 0]  # HF hidden_states of the last layer is after the final norm


@pytest.fixture(scope="module", params=sorted(HF_ONLY_FAMILIES))
def folder(request, tmp_path_factory):
    return write_hf_only_target(tmp_path_factory.mktemp(request.param), request.param)


def _reference(folder):
    """transformers' own forward, eager attention (the only kernel that applies soft-capping)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = hf(IDS, output_hidden_states=True)
        base = hf.get_decoder()(IDS)
    return hf, out, base.last_hidden_state


def test_capture_last_hidden_and_logits_equal_transformers(folder):
    hf, out, last = _reference(folder)
    model = load_target(folder, dtype=torch.float32, backend="transformers")
    assert model.args.num_hidden_layers == 3 and model.args.vocab_size == 300
    aux, got_last = model.capture(IDS, LAYERS)
    want_aux = torch.cat([out.hidden_states[i + 1] for i in LAYERS], dim=-1)
    # fp32, but Mistral runs sdpa here and eager in the reference
    tol = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(aux, want_aux, **tol)
    torch.testing.assert_close(got_last, last, **tol)
    with torch.no_grad():
        logits = model(IDS)
    torch.testing.assert_close(logits, out.logits, **tol)
    cap = getattr(hf.config, "final_logit_softcapping", None)
    if cap:  # the family's own head: capped logits
        assert float(logits.abs().max()) <= cap
    assert not any(p.requires_grad for p in model.parameters())
    torch.testing.assert_close(model.embed_weight(), hf.get_input_embeddings().weight)
    torch.testing.assert_close(model.lm_head_weight(), hf.get_output_embeddings().weight)


def test_window_and_softcap_change_the_capture(folder):
    """The reference is not blind to the features: turning them off changes the last hidden."""
    _, _, last = _reference(folder)
    plain = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", sliding_window=None if "mistral" in folder else 4096,
        **({"attn_logit_softcapping": None} if "gemma2" in folder else {}))
    with torch.no_grad():
        other = plain.get_decoder()(IDS).last_hidden_state
    assert (other - last).abs().max() > 1e-3


def test_cached_decode_equals_the_full_forward(folder):
    """Prefill, one token, a block of four, crop two of them, re-extend: every step's logits,
    captures and last hidden equal the uncached forward's at the same positions."""
    model = load_target(folder, dtype=torch.float32, backend="transformers")
    ids = IDS[:1, :24]
    with torch.no_grad():
        full_logits = model(ids).float()
    full_aux, full_last = model.capture(ids, LAYERS)
    cache = model.new_cache(1, 32)
    cuts = [(0, 12), (12, 13), (13, 17)]
    with torch.no_grad():
        for a, b in cuts:
            step = model(ids[:, a:b], LAYERS, True, cache=cache, logits="all")
            torch.testing.assert_close(step.logits, full_logits[:, a:b], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(step.aux, full_aux[:, a:b], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(step.last_hidden, full_last[:, a:b], rtol=1e-4, atol=1e-4)
        cache.crop(15)
        assert cache.length == 15
        step = model(ids[:, 15:24], None, False, cache=cache, logits="last")
    torch.testing.assert_close(step.logits, full_logits[:, 23:24], rtol=1e-4, atol=1e-4)


def test_left_padded_decode_equals_each_row_alone(folder):
    model = load_target(folder, dtype=torch.float32, backend="transformers")
    rows = [IDS[0, :10], IDS[1, :7]]
    pad = torch.tensor([0, 3])
    batch = torch.stack([rows[0], torch.cat([torch.zeros(3, dtype=torch.long), rows[1]])])
    cache = model.new_cache(2, 16, pad=pad)
    with torch.no_grad():
        step = model(batch, None, False, cache=cache, logits="last")
        for r, row in enumerate(rows):
            torch.testing.assert_close(step.logits[r, -1], model(row[None]).float()[0, -1], rtol=1e-4, atol=1e-4)


def test_packed_rows_and_static_cache_are_refused_with_one_line(folder):
    model = load_target(folder, dtype=torch.float32, backend="transformers")
    with pytest.raises(ValueError, match="data.packing = false"):
        model.capture(IDS, LAYERS, document_ids=torch.zeros_like(IDS))
    with pytest.raises(ValueError, match="--no-cuda-graphs"):
        model.new_cache(1, 8, static=True)
    from titan_draft.distributed.cuda_graphs import can_graph

    assert "transformers backend runs eagerly" in can_graph(model, torch.device("cuda"))  # eval and capture


def test_missing_transformers_names_the_install(folder, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_transformers(name, *a, **k):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    with pytest.raises(ValueError, match="pip install transformers"):
        load_target(folder, dtype=torch.float32, backend="transformers")
    # and a job says so at its start-up check, before any process group or weight
    import importlib.util

    from titan_draft.config.manager import load_job_config
    from titan_draft.features.target import check_target_config

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real_find(name, *a))
    cfg = load_job_config(["--target.backend", "transformers", "--target.path", folder])
    with pytest.raises(ValueError, match="^target.backend = 'transformers' needs the transformers package: pip install"):
        check_target_config(cfg)


def test_job_with_the_backend_and_packing_is_refused_naming_both():
    from titan_draft.config.manager import load_job_config
    from titan_draft.config.validate import ConfigError

    with pytest.raises(ConfigError, match="data.packing is not available with target.backend = 'transformers'"):
        load_job_config(["--target.backend", "transformers", "--target.path", "x", "--data.packing", "true",
                         "--data.max_length", "128"])
    with pytest.raises(ConfigError, match="target.backend = 'nope' must be one of native, transformers"):
        load_job_config(["--target.backend", "nope"])


def test_tables_read_alone_equal_the_loaded_model(folder):
    """Offline training reads only the embedding and LM head: the loaded model's, tied or not."""
    from titan_draft.protocols.target_spec import get_target_spec

    model = load_target(folder, dtype=torch.float32, backend="transformers")
    embed, head = get_target_spec("transformers").load_tables(folder, model.args)
    torch.testing.assert_close(embed, model.embed_weight(), rtol=0, atol=0)
    torch.testing.assert_close(head, model.lm_head_weight(), rtol=0, atol=0)
    assert (head is embed) == model.args.tie_word_embeddings


def test_compiled_capture_equals_eager(folder):
    model = load_target(folder, dtype=torch.float32, backend="transformers")
    want = model.capture(IDS, LAYERS)
    model.compile_capture("eager")
    got = model.capture(IDS, LAYERS)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
