"""The true-τ eval under data parallelism: two gloo ranks with a sharded target split the
prompts, keep their target forwards in lockstep (ranks decode different numbers of rounds) and
report exactly what one process reports."""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import replace

import pytest
import torch

from helpers import spawn_ranks, write_rank_result
from titan_draft import load_target
from titan_draft.features.target import write_random_target

# three prompts over two ranks: rank 1 is done after one and must keep stepping with rank 0
PROMPTS = [[5, 9, 11, 2], [7, 7, 3, 1, 8, 20, 4], [30, 1]]


def _report(folder: str, mesh=None) -> dict:
    from models.dflash2.args import dflash2_flavors
    from models.dflash2.model import DFlash2Draft
    from models.dflash2.proposal import DFlashProposer
    from titan_draft.decoding.acceptance import evaluate
    from titan_draft.data.chat.prompts import EvalPrompt

    target = load_target(folder, dtype=torch.float32, mesh=mesh)
    args = replace(dflash2_flavors["debugmodel"], vocab_size=target.args.vocab_size, target_layer_ids=[1, 3],
                   num_target_layers=6, mask_token_id=151669)
    torch.manual_seed(0)
    draft = DFlash2Draft(args)
    draft.init_weights()
    draft.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    prompts = [EvalPrompt(f"p{i}", p) for i, p in enumerate(PROMPTS)]
    report = evaluate(target, DFlashProposer(draft.eval()), prompts, max_new_tokens=6, stop_ids=[],
                      device=torch.device("cpu"))
    out = report.to_json()
    for p in out["prompts"]:  # timings differ between runs
        p.pop("speculative_s"), p.pop("greedy_s")
    for key in ("speculative_tokens_per_s", "greedy_tokens_per_s", "speedup"):
        out["summary"].pop(key)
    return out


def _worker(rank: int, port: int, folder: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    def compute():
        # a rank left waiting on a collective fails the test in a minute instead of hanging it
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        result = _report(folder, init_device_mesh("cpu", (2,)))
        dist.destroy_process_group()
        return result

    write_rank_result(out_dir, rank, compute)


@pytest.mark.slow
def test_two_ranks_report_what_one_reports(tmp_path):
    folder = write_random_target(str(tmp_path / "t"), dtype=torch.float32)
    spawn_ranks(_worker, folder, str(tmp_path))
    one = _report(folder)
    assert [p["name"] for p in one["prompts"]] == ["p0", "p1", "p2"]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "error" not in got, got["error"]
        assert got == one
