"""Stand-ins for scripts/compare_drafts.py's jobs: what a training job and an eval write (the
trainer's own TensorBoard scalars, the export's provenance, an eval report), without training."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from scripts import compare_drafts
from titan_draft.checkpoint.export import PROVENANCE_NAME
from titan_draft.components.metrics import MetricsLogger
from titan_draft.config.job_config import Metrics
from titan_draft.decoding.acceptance import EvalReport, PromptReport


def write_tb(dump: str, step_times: list[float], memory_steps: int = 0) -> None:
    """Scalars as the trainer logs them: its own MetricsLogger, every step a window."""
    logger = MetricsLogger(Metrics(log_freq=1), dump, rank=0, device_type="cpu")
    for step, t in enumerate(step_times, start=1):
        logger.log(step, {"step_time_s": t, "loss": 1.0}, len(step_times))
    logger.close()


def eval_report(temperature: float, rounds: list[int], tokens: list[int], accepted: list[list[int]],
            lossless: list[bool] | None, times=(1.0, 2.0)) -> dict:
    prompts = [PromptReport(name=f"p{i}", prompt_tokens=10, new_tokens=tokens[i], rounds=rounds[i],
                            round_tokens=tokens[i] - 1, tau=(tokens[i] - 1) / rounds[i], speculative_s=times[0],
                            accepted=accepted[i], greedy_s=times[1], lossless=None if lossless is None else lossless[i],
                            proposed=[4] * rounds[i])
               for i in range(len(rounds))]
    return {"target": "t", "draft": "d", "dtype": "float32", "proposer_options": {},
            **EvalReport(prompts, num_draft_tokens=4, max_new_tokens=16, temperature=temperature).to_json()}


def prompt_report(rounds_tokens: list[tuple[int, int]], names: list[str] | None = None) -> dict:
    """An eval report of given (rounds, round tokens) per prompt, its summary's tau theirs."""
    names = names or [f"mtbench:{81 + i}" for i in range(len(rounds_tokens))]
    prompts = [{"name": n, "prompt_tokens": 10, "new_tokens": t + 1, "rounds": r, "round_tokens": t, "tau": t / r,
                "speculative_s": 1.0, "accepted": [], "greedy_s": None, "lossless": None, "divergence": None,
                "proposed": [], "sampled_rounds": 0} for n, (r, t) in zip(names, rounds_tokens)]
    rounds, tokens = sum(r for r, _ in rounds_tokens), sum(t for _, t in rounds_tokens)
    summary = {"tau": tokens / rounds, "accept_rate": [0.5], "num_prompts": len(prompts), "lossless_prompts": None,
               "num_draft_tokens": 1, "proposed_per_round": 1.0, "rounds": rounds, "new_tokens": tokens,
               "draft_sampling": "greedy", "speculative_tokens_per_s": None, "greedy_tokens_per_s": None,
               "speedup": None}
    return {"summary": summary, "prompts": prompts}


def flat_config(cfg) -> dict:
    """Every resolved key of a job config as ``section.key`` (model args as ``model.args.<name>``)."""
    out = {}
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        for g in dataclasses.fields(section):
            value = getattr(section, g.name)
            if isinstance(value, dict):
                out.update({f"{f.name}.{g.name}.{k}": v for k, v in value.items()})
            else:
                out[f"{f.name}.{g.name}"] = value
    return out


class FakeJobs:
    """Stands in for compare_drafts.run_logged: records each command and writes what the real job
    would. ``stop_training_once``: the first training attempt stops (SIGTERM) before its export."""

    def __init__(self, stop_training_once: bool = False, interrupt_training_once: bool = False, report_for=None):
        self.report_for = report_for  # (out path, temperature) -> the eval's report; None: a fixed one
        self.calls: list[tuple[str, list[str]]] = []
        self.caches: list[tuple[str, str, bool]] = []  # (job, its compile cache, whether it existed before)
        self.stop_training_once = stop_training_once
        self.interrupt_training_once = interrupt_training_once

    def __call__(self, cmd, log_path, env_extra=None):
        with open(log_path, "a") as log:
            log.write("fake job\n")
        arg = dict(zip(cmd, cmd[1:]))  # each flag and what follows it
        if "titan_draft.eval" in cmd:
            self.calls.append(("eval", cmd))
            t = float(arg["--temperature"])
            rep = self.report_for(arg["--out"], t) if self.report_for else \
                eval_report(t, [4, 4], [12, 12], [[1, 2, 0, 1], [3, 0, 1, 1]], None if t > 0 else [True, True])
            Path(arg["--out"]).write_text(json.dumps(rep))
            return 0, 3.0
        dump, steps = arg["--job.dump_folder"], int(arg["--training.steps"])
        kind = "calibration" if arg.get("--metrics.log_freq") == "1" else "train"
        self.calls.append((kind, cmd))
        self.caches.append((kind, env_extra["TORCHINDUCTOR_CACHE_DIR"], os.path.exists(env_extra["TORCHINDUCTOR_CACHE_DIR"])))
        os.makedirs(env_extra["TORCHINDUCTOR_CACHE_DIR"], exist_ok=True)  # the job compiles into it
        times = [9.0, 3.0] + [0.5] * (steps - 2)
        if kind == "calibration":  # its save, after the step the comparison asked for, costs 2 s
            times[int(arg["--checkpoint.interval"])] += 2.0
        os.makedirs(os.path.join(dump, "checkpoint", "step-1"), exist_ok=True)
        if kind == "train" and self.interrupt_training_once:
            self.interrupt_training_once = False
            write_tb(dump, [9.0] + [0.5] * 4)
            raise compare_drafts.Interrupted(12.0)  # Ctrl-C: the job saved and stopped after 12 s
        if kind == "train" and self.stop_training_once:
            self.stop_training_once = False
            write_tb(dump, [9.0] + [0.5] * 9)
            return 0, 20.0  # stopped by a signal after a checkpoint: exit 0, no export
        write_tb(dump, times)
        os.makedirs(os.path.join(dump, "export"), exist_ok=True)
        Path(dump, "export", PROVENANCE_NAME).write_text(json.dumps({"step": steps}))
        return 0, (40.0 if kind == "calibration" else 35.0)
