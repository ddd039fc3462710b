"""scripts/write_random_target.py writes a folder that load_target, build_tokenizer and HF
transformers all read as an ordinary Qwen3 checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from models.targets.qwen3 import Qwen3Model, qwen3_flavors
from titan_draft import load_target
from titan_draft.features.target import write_random_target
from titan_draft.data.tokenizer import build_tokenizer
from helpers import REPO


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("rt") / "qwen3_debug"
    # the script itself, as a user runs it; shards to walk the index path
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "write_random_target.py"),
                    "--out", str(out), "--seed", "7", "--max-shard-gb", "0.005"], check=True)
    return str(out)


def test_folder_layout_and_weights(folder):
    names = set(os.listdir(folder))
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"} <= names
    assert sum(n.endswith(".safetensors") for n in names) >= 2
    cfg = json.loads(open(os.path.join(folder, "config.json")).read())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True

    model = load_target(folder, dtype=torch.float32)
    ref = Qwen3Model(qwen3_flavors["debugmodel"])
    ref.init_weights(seed=7)  # the random:debugmodel target with the same seed, rounded to bf16
    got = dict(model.state_dict())
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[name], value.to(torch.bfloat16).float(), rtol=0, atol=0, msg=name)
    assert model.lm_head.weight is model.embed_tokens.weight


def test_tokenizer_is_the_qwen3_tokenizer(folder):
    tok, ref = build_tokenizer(folder), build_tokenizer("qwen3")
    assert tok.encoding._mergeable_ranks == ref.encoding._mergeable_ranks
    assert tok.encoding._special_tokens == ref.encoding._special_tokens
    assert tok.unused_token_id(qwen3_flavors["debugmodel"].vocab_size) == 151669


def test_transformers_reads_it_the_same(folder):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_target(folder, dtype=torch.float32)
    ids = torch.randint(0, 151669, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "<|im_start|>user\nHello, 世界 123456<|im_end|>\n"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == build_tokenizer(folder).encode(text)


def test_existing_folder_is_kept(folder, capsys):
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        import write_random_target as script
    finally:
        sys.path.pop(0)
    before = os.path.getmtime(os.path.join(folder, "config.json"))
    script.main(["--out", folder])
    assert "already holds a checkpoint" in capsys.readouterr().out
    assert os.path.getmtime(os.path.join(folder, "config.json")) == before
    script.main(["--out", folder, "--force", "--seed", "7", "--max-shard-gb", "0.005"])  # rewritten
    assert "wrote random debugmodel" in capsys.readouterr().out
    assert os.path.getmtime(os.path.join(folder, "config.json")) > before
    with pytest.raises(ValueError, match="not a qwen3 target flavor"):
        write_random_target(folder + "_x", flavor="nope")
