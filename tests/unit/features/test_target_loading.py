"""load_target: every kind of bad folder gets its own message, and a 2-rank FSDP2 load of a
sharded folder reads only each rank's rows and computes what the 1-rank load computes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from models.targets.qwen3 import Qwen3Args, Qwen3Model, local_key_to_hf
from helpers import record_whole_tensor_reads, spawn_ranks, write_rank_result
from titan_draft import load_target

# vocab 301 and 3 kv heads x 16: rows that do not split evenly over 2 ranks
ARGS = dict(vocab_size=301, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
            num_attention_heads=3, num_key_value_heads=1, head_dim=16, max_position_embeddings=256)


def _hf_config(tied: bool) -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": tied, "torch_dtype": "float32", **ARGS}


def _state_dict(tied: bool) -> dict[str, torch.Tensor]:
    model = Qwen3Model(Qwen3Args(**ARGS, tie_word_embeddings=tied, rope_theta=10000.0))
    model.init_weights(seed=3)
    with torch.no_grad():  # non-unit norms, so a norm loaded into the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    sd = {local_key_to_hf(k): v.clone() for k, v in model.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight")
    return sd


def write_folder(folder, *, tied=False, shards=1, config_patch=None, sd_patch=None) -> str:
    """A Qwen3 HF folder written with plain safetensors (``shards`` > 1: an index + shards)."""
    os.makedirs(folder, exist_ok=True)
    cfg = {**_hf_config(tied), **(config_patch or {})}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    sd = _state_dict(tied)
    if sd_patch:
        sd_patch(sd)
    if shards == 1:
        save_file(sd, os.path.join(folder, "model.safetensors"))
        return str(folder)
    keys = sorted(sd)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[i::shards]}
        save_file(part, os.path.join(folder, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(folder)


IDS = torch.randint(0, ARGS["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0))


def _reference(tied: bool):
    """Outputs of the plain eager model on the same weights, built without load_target."""
    model = Qwen3Model(Qwen3Args(**ARGS, tie_word_embeddings=tied, rope_theta=10000.0))
    sd = _state_dict(tied)
    local = {k[len("model."):] if k.startswith("model.") else k: v for k, v in sd.items()}
    model.load_state_dict(local, strict=not tied)
    with torch.no_grad():
        return model.capture(IDS, [0, 2]), model(IDS)


@pytest.mark.parametrize("tied,shards", [(False, 1), (True, 3)])
def test_load_target_matches_eager_model(tmp_path, tied, shards):
    folder = write_folder(tmp_path / "m", tied=tied, shards=shards)
    model = load_target(folder, dtype=torch.float32, device="cpu")
    assert model.family == "qwen3" and not any(p.requires_grad for p in model.parameters())
    assert (model.lm_head.weight is model.embed_tokens.weight) == tied
    (ref_aux, ref_last), ref_logits = _reference(tied)
    with torch.no_grad():
        aux, last = model.capture(IDS, [0, 2])
        torch.testing.assert_close(aux, ref_aux, rtol=0, atol=0)
        torch.testing.assert_close(last, ref_last, rtol=0, atol=0)
        torch.testing.assert_close(model(IDS), ref_logits, rtol=0, atol=0)
    bf16 = load_target(folder, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())


def _drop(key):
    return lambda sd: sd.pop(key)


def _index_patch(folder, fn):
    path = os.path.join(folder, "model.safetensors.index.json")
    with open(path) as f:
        index = json.load(f)
    fn(index)
    with open(path, "w") as f:
        json.dump(index, f)


def _bad_folders(root):
    """(name, folder, exception type, message regex) for each kind of unusable folder."""
    cases = [("not a folder", str(root / "nope"), ValueError, "does not exist or is not a folder")]
    d = root / "no_config"
    d.mkdir()
    cases.append(("no config.json", str(d), ValueError, "has no config.json"))
    cases.append(("unknown model_type", write_folder(root / "gemma", config_patch={"model_type": "gemma2"}),
                  ValueError, "model_type 'gemma2'; supported"))
    cases.append(("quantized", write_folder(root / "fp8", config_patch={"quantization_config": {"quant_method": "fp8"}}),
                  ValueError, r"quantized checkpoint \(fp8\)"))
    cases.append(("sliding window", write_folder(root / "swa", config_patch={"use_sliding_window": True}),
                  ValueError, "sliding-window"))
    for key in ("attention_bias", "mlp_bias"):
        cases.append((key, write_folder(root / key, config_patch={key: True}), ValueError, f"sets {key}=true"))
    d = write_folder(root / "no_weights")
    os.remove(os.path.join(d, "model.safetensors"))
    cases.append(("no weights", d, FileNotFoundError, "no model.safetensors or model.safetensors.index.json"))
    d = write_folder(root / "missing_shard", shards=2)
    os.remove(os.path.join(d, "model-00002-of-00002.safetensors"))
    cases.append(("missing shard", d, FileNotFoundError, r"shard 'model-00002-of-00002.safetensors' .* is missing"))
    d = write_folder(root / "stale_index", shards=2)
    def swap(ix):  # map one key to the other shard
        wm = ix["weight_map"]
        wm["model.norm.weight"] = next(v for v in set(wm.values()) if v != wm["model.norm.weight"])

    _index_patch(d, swap)
    cases.append(("stale index", d, KeyError, "'model.norm.weight' is stored in .* maps it to"))
    cases.append(("missing key", write_folder(root / "missing", sd_patch=_drop("model.layers.1.mlp.up_proj.weight")),
                  KeyError, r"missing keys in .*model.layers.1.mlp.up_proj.weight"))
    cases.append(("unexpected key", write_folder(root / "extra", sd_patch=lambda sd: sd.update({"model.extra.bias": torch.zeros(3)})),
                  KeyError, r"unexpected key 'model.extra.bias' in .*model.safetensors"))
    cases.append(("shape mismatch", write_folder(root / "shape", sd_patch=lambda sd: sd.update({"model.norm.weight": torch.ones(47)})),
                  ValueError, r"shape mismatch for 'model.norm.weight' in .*: checkpoint \(47,\), model \(48,\)"))
    cases.append(("config/weights disagree", write_folder(root / "cfg", config_patch={"intermediate_size": 96}),
                  ValueError, r"shape mismatch for 'model.layers.0.mlp"))
    cases.append(("bad index json", write_folder(root / "badjson", shards=2), ValueError, "is not valid JSON"))
    with open(os.path.join(cases[-1][1], "model.safetensors.index.json"), "w") as f:
        f.write("{not json")
    return cases


def test_each_bad_folder_names_its_problem(tmp_path):
    cases = _bad_folders(tmp_path)
    assert len({name for name, *_ in cases}) == len(cases) == 15
    for name, folder, exc, message in cases:
        with pytest.raises(exc, match=message):
            load_target(folder, dtype=torch.float32)
            pytest.fail(f"{name}: loaded")


# ------------------------------------------------------------------------------------------
# 2 ranks, gloo


def _worker(rank: int, port: int, folder: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    def compute():
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2,))
        full_reads = record_whole_tensor_reads()
        model = load_target(folder, dtype=torch.float32, device="cpu", mesh=mesh)
        local = sum(p.to_local().numel() for p in model.parameters())
        total = sum(p.numel() for p in model.parameters())
        assert all(isinstance(p, DTensor) for p in model.parameters())
        with torch.no_grad():
            aux, last = model.capture(IDS, [0, 2])
            logits = model(IDS)
        torch.save({"aux": aux, "last": last, "logits": logits}, os.path.join(out_dir, f"out{rank}.pt"))
        dist.destroy_process_group()
        return {"full_reads": full_reads, "local": local, "total": total}

    write_rank_result(out_dir, rank, compute)


@pytest.mark.slow
def test_two_rank_sharded_load_matches_one_rank(tmp_path):
    folder = write_folder(tmp_path / "m", tied=True, shards=2)
    spawn_ranks(_worker, folder, str(tmp_path))
    one = load_target(folder, dtype=torch.float32)
    with torch.no_grad():
        aux, last = one.capture(IDS, [0, 2])
        logits = one(IDS)
    for rank in range(2):
        info = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in info, info["error"]
        assert info["full_reads"] == []  # only get_slice: this rank's rows
        # each rank holds about half of the parameters, never the whole model
        assert info["local"] < 0.6 * info["total"]
        out = torch.load(tmp_path / f"out{rank}.pt")
        torch.testing.assert_close(out["aux"], aux, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out["last"], last, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out["logits"], logits, rtol=1e-6, atol=1e-6)
