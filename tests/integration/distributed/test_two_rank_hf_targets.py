"""target.backend = "transformers" sharded over two gloo ranks (FSDP2 per decoder layer) captures
what one unsharded process captures, each rank holding about half of the weights and reading only
its rows from disk (never the whole folder, never a whole tensor)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import record_whole_tensor_reads, spawn_ranks, write_rank_result
from hf_folders import HF_ONLY_FAMILIES, write_hf_only_target

from titan_draft.features.target import load_target

pytest.importorskip("transformers")

IDS = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(5))
LAYERS = [2, 0]


def _capture(model) -> dict:
    with torch.no_grad():
        aux, last = model.capture(IDS, LAYERS)
        return {"aux": aux, "last": last, "logits": model(IDS), "embed": model.embed_weight(),
                "lm_head": model.lm_head_weight()}


def _worker(rank: int, port: int, root: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    def compute():
        import transformers

        def no_whole_folder(*a, **k):
            raise AssertionError("a rank loaded the whole folder with from_pretrained")

        transformers.AutoModelForCausalLM.from_pretrained = no_whole_folder
        whole_reads = record_whole_tensor_reads()
        import models.targets.qwen3.state_dict as st

        copied = []  # bytes each copy from disk wrote into this rank's tensors
        real_copy = st._copy_from_file

        def counting_copy(dst, f, key, row=None):
            copied.append(dst.to_local().numel() * dst.element_size())
            return real_copy(dst, f, key, row)

        st._copy_from_file = counting_copy
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (2,))
        result = {}
        for family in HF_ONLY_FAMILIES:
            copied.clear()
            model = load_target(os.path.join(root, family), dtype=torch.float32, mesh=mesh, backend="transformers")
            assert all(isinstance(p, DTensor) for p in model.parameters())
            torch.save(_capture(model), os.path.join(root, f"{family}{rank}.pt"))
            result[family] = {"local": sum(p.to_local().numel() for p in model.parameters()),
                              "total": sum(p.numel() for p in model.parameters()), "whole_reads": list(whole_reads),
                              "read_bytes": sum(copied), "total_bytes": 4 * sum(p.numel() for p in model.parameters())}
        dist.destroy_process_group()
        return result

    write_rank_result(root, rank, compute)


@pytest.mark.slow
def test_sharded_hf_targets_capture_what_one_rank_captures(tmp_path):
    for family in HF_ONLY_FAMILIES:
        write_hf_only_target(tmp_path / family, family)
    spawn_ranks(_worker, str(tmp_path))
    for family in HF_ONLY_FAMILIES:
        want = _capture(load_target(str(tmp_path / family), dtype=torch.float32, backend="transformers"))
        for rank in range(2):
            info = json.loads((tmp_path / f"rank{rank}.json").read_text())
            assert "error" not in info, info["error"]
            assert info[family]["local"] < 0.6 * info[family]["total"]
            assert info[family]["whole_reads"] == []  # only this rank's rows of each tensor were read
            assert 0 < info[family]["read_bytes"] < 0.6 * info[family]["total_bytes"]
            got = torch.load(tmp_path / f"{family}{rank}.pt")
            for key, value in want.items():
                torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-5, msg=f"{family} {key} rank {rank}")
