"""target.backend = "transformers": what the drafts receive (input embedding, LM head, teacher
logits) is what they get at serving, or the job is refused in one line at start-up."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_folders import write_hf_only_target

from models.targets.hf.serving import check_serving_conventions, head_transforms
from titan_draft.config.manager import load_job_config
from titan_draft.features.target import check_target_config, load_target
from titan_draft.protocols.target_spec import get_target_spec

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return write_hf_only_target(tmp_path_factory.mktemp("gemma2"), "gemma2")


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    return write_hf_only_target(tmp_path_factory.mktemp("mistral"), "mistral")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("gemma3"))
    config = transformers.Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    transformers.Gemma3ForCausalLM(config).save_pretrained(folder)
    return folder


def _config(folder: str) -> dict:
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


def _checkpoint_table(folder: str, name: str = "model.embed_tokens.weight") -> torch.Tensor:
    from safetensors import safe_open

    index = os.path.join(folder, "model.safetensors.index.json")
    with open(index) as f:
        file = json.load(f)["weight_map"][name]
    with safe_open(os.path.join(folder, file), "pt") as f:
        return f.get_tensor(name)


def test_gemma2_draft_embedding_is_the_raw_table_as_sglang_serves_it(gemma2):
    """SGLang's Gemma2 embedding module is a plain table (the decoder's forward scales by
    sqrt(hidden)); EAGLE3 and DFlash drafts both embed through that table: the raw rows."""
    model = load_target(gemma2, dtype=torch.float32, backend="transformers")
    raw = _checkpoint_table(gemma2)
    draft_side = torch.nn.functional.embedding(IDS, model.embed_weight())
    torch.testing.assert_close(draft_side, raw[IDS], rtol=0, atol=0)
    torch.testing.assert_close(model.lm_head_weight(), raw, rtol=0, atol=0)  # tied: the same table
    # transformers' own module carries the family's scale: the drafts do not take it from there
    hf_module = model.hf.get_input_embeddings()(IDS)
    torch.testing.assert_close(hf_module, raw[IDS] * 64 ** 0.5)


def test_gemma3_whose_embedding_module_scales_is_refused_in_one_line(gemma3):
    with pytest.raises(ValueError, match=r"^target.backend = 'transformers': model_type 'gemma3_text' is not supported: "
                                         r"Gemma3's embedding module multiplies") as e:
        load_target(gemma3, dtype=torch.float32, backend="transformers")
    assert "\n" not in str(e.value)
    spec = get_target_spec("transformers")
    with pytest.raises(ValueError, match="gemma3_text' is not supported"):  # offline: the tables alone
        spec.load_tables(gemma3, None)
    cfg = load_job_config(["--target.backend", "transformers", "--target.path", gemma3, "--model.name", "dflash2"])
    with pytest.raises(ValueError, match="gemma3_text' is not supported"):  # start-up, before any weight
        check_target_config(cfg)
    # the reason is real: transformers' Gemma3 module output is the table times sqrt(hidden)
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32)
    emb = hf.get_input_embeddings()
    torch.testing.assert_close(emb(IDS), emb.weight[IDS] * 8.0)


def test_teacher_logits_of_last_hidden_equal_transformers_without_head_transforms(mistral):
    """What DSpark's and EAGLE3's teacher computes (last_hidden @ lm_head.T) is the family's own
    logits when its head is a plain projection."""
    model = load_target(mistral, dtype=torch.float32, backend="transformers")
    _, last = model.capture(IDS, [0])
    hf = transformers.AutoModelForCausalLM.from_pretrained(mistral, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = hf(IDS).logits
    torch.testing.assert_close(last @ model.lm_head_weight().t(), want, rtol=1e-4, atol=1e-4)
    assert head_transforms(_config(mistral)) == []


def test_soft_capped_head_refuses_a_draft_with_a_teacher_at_start_up(gemma2):
    hf_config = _config(gemma2)
    model = load_target(gemma2, dtype=torch.float32, backend="transformers")
    _, last = model.capture(IDS, [0])
    with torch.no_grad():
        served = model(IDS)
    # the plain product is not what Gemma2 serves: the refusal below guards a real difference
    assert (last @ model.lm_head_weight().t() - served).abs().max() > 1e-3  # 10x the tolerance used below
    cap = hf_config["final_logit_softcapping"]
    torch.testing.assert_close(cap * torch.tanh(last @ model.lm_head_weight().t() / cap), served, rtol=1e-4, atol=1e-4)
    for draft in ("dspark", "eagle3"):
        cfg = load_job_config(["--target.backend", "transformers", "--target.path", gemma2, "--model.name", draft])
        with pytest.raises(ValueError, match=r"applies final_logit_softcapping = 3.0 to its logits, .*dflash2") as e:
            check_target_config(cfg)
        assert "\n" not in str(e.value)
    check_serving_conventions(hf_config, needs_teacher=False)  # dflash2 reads no teacher: accepted


def test_head_transforms_name_granite_and_cohere_scales():
    assert head_transforms({"model_type": "granite", "logits_scaling": 8.0, "embedding_multiplier": 12.0}) == \
        ["logits_scaling = 8.0"]
    assert head_transforms({"model_type": "cohere", "logit_scale": 0.0625}) == ["logit_scale = 0.0625"]
    assert head_transforms({"model_type": "granite", "logits_scaling": 1.0}) == []
    with pytest.raises(ValueError, match="logits_scaling = 8.0"):
        check_serving_conventions({"model_type": "granite", "logits_scaling": 8.0}, needs_teacher=True)


def test_soft_capped_attention_runs_the_eager_kernel_whatever_the_default(gemma2, monkeypatch):
    """Gemma2's soft-capped attention scores: only the eager kernel computes them. Whatever kernel a
    transformers version picks by default for the family (here pinned to sdpa, which has no score
    transform: some versions ignore the cap there, this one refuses it), the backend captures what
    the eager forward computes."""
    ref = transformers.AutoModelForCausalLM.from_pretrained(gemma2, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        want = ref(IDS, output_hidden_states=True).hidden_states
    original = transformers.PreTrainedModel.get_correct_attn_implementation

    def sdpa_by_default(self, requested, is_init_check=False):
        return "sdpa" if requested is None else original(self, requested, is_init_check)

    monkeypatch.setattr(transformers.PreTrainedModel, "get_correct_attn_implementation", sdpa_by_default)
    monkeypatch.setattr(transformers.PreTrainedModel, "_sdpa_can_dispatch", lambda self, *a, **k: True)
    assert transformers.AutoModelForCausalLM.from_pretrained(gemma2).config._attn_implementation == "sdpa"
    model = load_target(gemma2, dtype=torch.float32, device="cpu", backend="transformers")
    assert model.hf.config._attn_implementation == "eager"
    aux, _ = model.capture(IDS, [0, 1])
    h = model.args.hidden_size
    for k in (0, 1):
        torch.testing.assert_close(aux[..., k * h:(k + 1) * h], want[k + 1], rtol=1e-4, atol=1e-5)
