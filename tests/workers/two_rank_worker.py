"""Run under torchrun by tests/integration/distributed/test_two_rank_float8.py: several drafts' jobs one after another in
the same ranks, so the process-group start-up and torch.compile's warm-up are paid once.

argv: ``jobs.json`` (draft name -> trainer argv) and an output folder; every rank writes
``rank{r}.json`` there after each job (the steps it logged, or the traceback of the error it
raised). After an error the rank exits at once: the other rank may be waiting in a collective
that will never come, and torchrun ends it when one rank exits non-zero."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch.distributed as dist

from titan_draft.distributed.utils import destroy_distributed
from titan_draft.logger import init_logger
from helpers import run_training  # tests/ is on PYTHONPATH (helpers.torchrun)


def main() -> None:
    init_logger()  # the trainer's log, as python -m titan_draft.train prints it (the test shows its tail)
    jobs_path, out = sys.argv[1], sys.argv[2]
    with open(jobs_path) as f:
        jobs = json.load(f)
    results: dict[str, dict] = {}
    rank = int(os.environ["RANK"])

    def write() -> None:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)

    for name, argv in jobs.items():
        try:
            results[name] = {"steps": sorted(run_training(argv, keep_process_group=True))}
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            write()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        write()
        dist.barrier()  # the next job starts on every rank from a finished one
    destroy_distributed()


if __name__ == "__main__":
    main()
