"""Under data parallelism every rank takes the same stop decision: a signal or a non-finite weight
seen by one rank stops them all at the same point (2 gloo ranks)."""

from __future__ import annotations

import json
import signal

import torch
import torch.distributed as dist
from torch import nn

from helpers import spawn_ranks, write_rank_result
from titan_draft.components.nonfinite import NonFiniteError, NonFiniteGuard
from titan_draft.components.signals import StopSignal


def _worker(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def compute():
        stop = StopSignal()
        before = stop.requested()
        if rank == 1:
            stop.signum = signal.SIGTERM  # what rank 1's handler records; rank 0 got nothing
        after = stop.requested()
        model = nn.Linear(2, 2)
        if rank == 1:
            with torch.no_grad():
                model.weight[0, 0] = float("inf")
        try:
            NonFiniteGuard("stop", 1, model).check_params(3)
            raised = None
        except NonFiniteError as e:
            raised = str(e)
        return {"before": before, "after": after, "raised": raised}

    try:
        write_rank_result(out_dir, rank, compute)
    finally:
        dist.destroy_process_group()


def test_one_ranks_signal_or_bad_weight_stops_every_rank(tmp_path):
    spawn_ranks(_worker, str(tmp_path))
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert "error" not in res, res.get("error")
        assert res["before"] is False and res["after"] is True, (r, res)
    assert results[1]["raised"].startswith("training: step 3: non-finite weights in weight;")
    assert results[0]["raised"].startswith("training: step 3: non-finite weights on another rank;")
