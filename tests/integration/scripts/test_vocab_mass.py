"""scripts/vocab_mass.py: the target's probability outside a draft vocabulary along its own
decodes, checked against HF transformers in float64 on the same tokens (greedy decodes that
transformers reproduces, sampled ones whose masses it recomputes), and bad exports refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from scripts import vocab_mass

transformers = pytest.importorskip("transformers")


def _export(folder, in_vocab: torch.Tensor | None) -> str:
    folder.mkdir()
    tensors = {"d2t": torch.zeros(1, dtype=torch.int64)} if in_vocab is None else {"t2d": in_vocab}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    return str(folder)


@pytest.fixture
def prompts(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Name three colours.", "What is 2 + 2?")))
    return str(path)


def test_the_mass_outside_is_the_targets_own_along_its_decodes(tmp_path, random_target_dir, prompts):
    hf = transformers.AutoModelForCausalLM.from_pretrained(random_target_dir, dtype=torch.float64).eval()
    vocab = hf.config.vocab_size
    args = ["--target", random_target_dir, "--prompts", prompts, "--max-new-tokens", "12", "--device", "cpu"]
    # a vocabulary of a random third of the tokens, without the second prompt's greedy tokens: its
    # greedy positions all lie outside, the first prompt's where its tokens are the second's
    whole = _export(tmp_path / "whole", torch.ones(vocab, dtype=torch.bool))
    first = vocab_mass.main([*args, "--draft", whole, "--temperatures", "0"])
    in_vocab = torch.zeros(vocab, dtype=torch.bool)
    in_vocab[torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[: vocab // 3]] = True
    in_vocab[first["decodes"]["0"][1]["tokens"]] = False
    assert first["drafts"][whole]["temperatures"]["0"]["mean"] == 0
    draft = _export(tmp_path / "export", in_vocab)
    out = tmp_path / "mass.json"
    result = vocab_mass.main([*args, "--draft", f"{draft},{whole}", "--temperatures", "0,1,0.5", "--dtype", "float64",
                              "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["drafts"][draft]["draft_vocab_size"] == int(in_vocab.sum())
    assert result["decodes"]["0"][1]["outside"][0] == [1.0] * 12
    for t, decodes in result["decodes"].items():
        masses = []
        assert len(decodes) == 2
        for p in decodes:
            ids = torch.tensor([p["prompt_ids"] + p["tokens"]])
            with torch.no_grad():
                logits = hf(ids).logits[0, len(p["prompt_ids"]) - 1: ids.shape[1] - 1]
            if t == "0":  # the greedy decode is the target's own, and the mass is whether the argmax is outside
                greedy = hf.generate(torch.tensor([p["prompt_ids"]]), max_new_tokens=len(p["tokens"]),
                                     do_sample=False)[0, len(p["prompt_ids"]):]
                assert greedy.tolist()[: len(p["tokens"])] == p["tokens"]
                want = (~in_vocab[logits.argmax(-1)]).double()
            else:
                want = 1 - torch.softmax(logits / float(t), dim=-1)[:, in_vocab].sum(-1)
            assert p["outside"][0] == pytest.approx(want.tolist(), abs=1e-6), (t, p["name"])
            assert p["outside"][1] == pytest.approx([0.0] * len(p["tokens"]), abs=1e-9)  # the whole vocabulary
            masses += want.tolist()
        figures = result["drafts"][draft]["temperatures"][t]
        assert figures["positions"] == len(masses) > 0
        assert figures["mean"] == pytest.approx(sum(masses) / len(masses), abs=1e-6)
    # T > 0 samples: another seed, other tokens
    again = vocab_mass.main([*args, "--draft", draft, "--temperatures", "1", "--seed", "7"])
    assert [p["tokens"] for p in again["decodes"]["1"]] != [p["tokens"] for p in result["decodes"]["1"]]


@pytest.mark.parametrize("case, message", [
    ("no_t2d", "no t2d tensor (its draft proposes from the target's whole vocabulary"),
    ("other_chat", "was trained in another chat format than"),
    ("short_t2d", "t2d covers 7 tokens, the target has"),
    ("temperature", "--temperatures 'x': expected numbers"),
    ("no_folder", "has no model.safetensors"),
    ("bad_prompts", "is not one of mtbench, holdout or an existing .jsonl file"),
    ("other_target", "is not the target"),
])
def test_what_it_cannot_measure_gets_one_line(tmp_path, random_target_dir, prompts, capsys, case, message):
    vocab = transformers.AutoConfig.from_pretrained(random_target_dir).vocab_size
    draft = _export(tmp_path / "export", {"no_t2d": None, "short_t2d": torch.ones(7, dtype=torch.bool)}.get(
        case, torch.ones(vocab, dtype=torch.bool)))
    if case in ("other_chat", "other_target"):  # a second export: another chat format, or a 99-layer target
        other = _export(tmp_path / "other", torch.ones(vocab, dtype=torch.bool))
        record = {"run": {"chat_template": "chatml"}} if case == "other_chat" else {"target": {"num_hidden_layers": 99}}
        (tmp_path / "other" / "titan_draft_export.json").write_text(json.dumps(record))
        draft = f"{draft},{other}"
    if case == "no_folder":
        draft = str(tmp_path / "nowhere")
    with pytest.raises(SystemExit) as e:
        vocab_mass.main(["--target", random_target_dir, "--draft", draft, "--device", "cpu",
                         "--prompts", "elsewhere" if case == "bad_prompts" else prompts,
                         *(["--temperatures", "x"] if case == "temperature" else [])])
    assert message in str(e.value) and "\n" not in str(e.value)
