"""The native Qwen2 and Qwen3-MoE targets sharded over two gloo ranks capture what one unsharded
process captures, each rank reading and holding only its rows (for the MoE: its experts)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import record_whole_tensor_reads, spawn_ranks, write_rank_result

from titan_draft import load_target

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(5))
LAYERS = [2, 0]
COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40,
                       norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=True)),
}


def _write(folder: str, family: str) -> str:
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**COMMON, **extra))
    with torch.no_grad():  # biases and the router start at zero in HF
        for name, p in hf.named_parameters():
            if "bias" in name or "mlp.gate." in name:
                p.normal_(0, 0.5)
    hf.save_pretrained(folder, max_shard_size="100KB")  # shards + index, as real checkpoints
    return folder


def _capture(model) -> dict:
    with torch.no_grad():
        aux, last = model.capture(IDS, LAYERS)
        return {"aux": aux, "last": last, "logits": model(IDS)}


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    def compute():
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2,))
        full_reads = record_whole_tensor_reads()
        result = {}
        for family in FAMILIES:
            model = load_target(os.path.join(root, family), dtype=torch.float32, device="cpu", mesh=mesh)
            assert all(isinstance(p, DTensor) for p in model.parameters())
            torch.save(_capture(model), os.path.join(root, f"{family}{rank}.pt"))
            experts = model.layers["0"].mlp.experts.gate_proj if family == "qwen3_moe" else None
            result[family] = {
                "local": sum(p.to_local().numel() for p in model.parameters()),
                "total": sum(p.numel() for p in model.parameters()),
                "local_experts": None if experts is None else experts.to_local().shape[0],
            }
        result["full_reads"] = full_reads
        dist.destroy_process_group()
        return result

    write_rank_result(root, rank, compute)


@pytest.mark.slow
def test_sharded_native_targets_capture_what_one_rank_captures(tmp_path):
    for family in FAMILIES:
        _write(str(tmp_path / family), family)
    spawn_ranks(_worker, str(tmp_path))
    for family in FAMILIES:
        one = load_target(str(tmp_path / family), dtype=torch.float32)
        assert one.family == family
        want = _capture(one)
        for rank in range(2):
            info = json.loads((tmp_path / f"rank{rank}.json").read_text())
            assert "error" not in info, info["error"]
            assert info["full_reads"] == []  # only this rank's slices (experts) were read
            assert info[family]["local"] < 0.6 * info[family]["total"]
            if family == "qwen3_moe":
                assert info[family]["local_experts"] == 3  # 6 experts over 2 ranks
            got = torch.load(tmp_path / f"{family}{rank}.pt")
            for key in want:
                torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-6, msg=f"{family} {key}")
