"""The ``[eval]`` section during training: the true acceptance length of the live draft, measured by
real speculative decoding against the frozen target (``acceptance.evaluate``)."""

from __future__ import annotations

import json
import logging
import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from titan_draft.components.metrics import due_every
from titan_draft.data.chat.prompts import load_eval_prompts, stop_token_ids
from titan_draft.decoding.acceptance import EvalReport, evaluate

logger = logging.getLogger(__name__)


def build_eval_draft(spec, args, state_dict: dict, target, device: torch.device, dtype: torch.dtype):
    """A plain (unsharded, uncompiled, eval-mode) copy of the draft in ``dtype``, with the
    target's frozen tables: what the proposer decodes with."""
    with torch.device(device):
        model = spec.model_cls(args)
    model.load_state_dict({k: v.to(device=device) for k, v in state_dict.items()}, strict=True)
    model.to(dtype).eval().requires_grad_(False)
    model.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    return model


class Evaluator:
    """The ``[eval]`` section during training: prompts rendered once at start (so a bad source
    fails before training), the measurement every ``eval.interval`` steps and at the end."""

    def __init__(self, cfg, spec, model_args, target, tokenizer, chat, device: torch.device, reserved_ids=()):
        e = cfg.eval
        self.cfg, self.spec, self.model_args = cfg, spec, model_args
        self.target, self.device = target, device
        self.enabled = e.enable
        if not self.enabled:
            return
        if spec.build_proposer_fn is None:
            raise ValueError(f"eval.enable: draft {spec.name!r} has no proposer (build_proposer_fn)")
        d = cfg.data
        self.prompts = load_eval_prompts(
            list(e.prompts), tokenizer, template=chat.template, system_prompt=chat.system_prompt,
            enable_thinking=chat.enable_thinking, num_prompts=e.num_prompts, data_source=d.source,
            holdout_rows=d.holdout_rows, max_prompt_tokens=e.max_prompt_tokens,
        )
        reserved = set(reserved_ids)
        kept = [p for p in self.prompts if reserved.isdisjoint(p.ids)]
        if len(kept) < len(self.prompts):
            logger.warning(f"eval: {len(self.prompts) - len(kept)} prompts hold a token the draft reserves "
                           f"({sorted(reserved)}) and are left out")
        self.prompts = kept
        if not self.prompts:
            raise ValueError(f"eval.prompts: {list(e.prompts)} gave no prompts")
        self.stop_ids = stop_token_ids(tokenizer, chat.template)
        self.folder = os.path.join(cfg.job.dump_folder, e.folder)
        self.greedy_cache: dict = {}  # the frozen target's plain decodes, the same at every eval

    def should_run(self, step: int, total_steps: int) -> bool:
        return self.enabled and due_every(step, total_steps, self.cfg.eval.interval)

    def run(self, model, step: int, is_rank0: bool) -> EvalReport:
        """Measure the live (possibly sharded, compiled) draft at ``step`` (collective)."""
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        dtype = next(iter(self.target.parameters())).dtype
        draft = build_eval_draft(self.spec, self.model_args, state, self.target, self.device, dtype)
        del state
        report = evaluate(self.target, self.spec.build_proposer_fn(draft), self.prompts,
                          max_new_tokens=self.cfg.eval.max_new_tokens, stop_ids=self.stop_ids,
                          device=self.device, check_lossless=self.cfg.eval.check_lossless,
                          cuda_graphs=self.cfg.eval.cuda_graphs, greedy_cache=self.greedy_cache)
        del draft
        if is_rank0:
            os.makedirs(self.folder, exist_ok=True)
            with open(os.path.join(self.folder, f"step-{step}.json"), "w") as f:
                json.dump(report.to_json(), f, indent=2)
            logger.info(f"eval at step {step}:\n{report.table()}")
        return report


def report_scalars(report: EvalReport) -> dict[str, float]:
    """TensorBoard scalars of one eval (under ``eval/``)."""
    s = report.summary()
    out = {"eval/tau": s["tau"], "eval/tau_prompt_mean": s["tau_prompt_mean"]}
    if s["tau_interval"] is not None:  # the band the prompts drawn leave tau in (95 %)
        out["eval/tau_low"], out["eval/tau_high"] = s["tau_interval"]["low"], s["tau_interval"]["high"]
    for k, rate in enumerate(s["accept_rate"], 1):
        out[f"eval/accept_rate_{k}"] = rate
    for key in ("speculative_tokens_per_s", "greedy_tokens_per_s", "speedup"):
        if s[key] is not None:
            out[f"eval/{key}"] = s[key]
    if s["lossless_prompts"] is not None:
        out["eval/lossless_fraction"] = s["lossless_prompts"] / max(s["num_prompts"], 1)
    return out
