"""True acceptance length: a trained draft decoding next to its real target.

    python -m titan_draft.eval --target outputs/targets/smollm2 --draft outputs/smollm2/export

``--draft`` is an export folder (``config.json`` + ``model.safetensors``, ours or any draft in
the serving contract its spec reads) or a DCP checkpoint ``<dump>/checkpoint/step-N`` (its dump
folder's ``model_args.json`` says what was trained). Prompts are MT-Bench's first turns by
default, rendered with the chat format the draft was trained on. Every prompt is decoded twice,
speculatively and plainly (greedy, KV-cached, batch 1): τ, acceptance per draft position,
tokens/s of both and the lossless check come out as a table and, with ``--out``, as JSON.

During training the ``[eval]`` section runs the same measurement (:class:`Evaluator`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from titan_draft.components.acceptance import EvalReport, evaluate
from titan_draft.components.export import PROVENANCE_NAME, load_export
from titan_draft.components.metrics import due_every
from titan_draft.components.target import load_target
from titan_draft.data.chat_template import resolve_template
from titan_draft.data.prompts import load_eval_prompts, stop_token_ids
from titan_draft.data.system_prompt import resolve_system_prompt
from titan_draft.data.tokenizer import build_tokenizer
from titan_draft.protocols import get_model_spec

logger = logging.getLogger(__name__)

MODEL_ARGS_NAME = "model_args.json"
RUN_INFO_NAME = "run_info.json"


def build_eval_draft(spec, args, state_dict: dict, target, device: torch.device, dtype: torch.dtype):
    """A plain (unsharded, uncompiled, eval-mode) copy of the draft in ``dtype``, with the
    target's frozen tables: what the proposer decodes with."""
    with torch.device(device):
        model = spec.model_cls(args)
    model.load_state_dict({k: v.to(device=device) for k, v in state_dict.items()}, strict=True)
    model.to(dtype).eval().requires_grad_(False)
    model.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    return model


def save_model_args(args, folder: str) -> None:
    """What the draft is, next to its checkpoints (so a DCP checkpoint can be evaluated)."""
    with open(os.path.join(folder, MODEL_ARGS_NAME), "w") as f:
        json.dump(dataclasses.asdict(args), f, indent=2)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--draft: cannot read {path}: {e}") from None


def load_draft_source(path: str, name: str | None) -> tuple:
    """``(spec, args, state_dict, run_info)`` of an export folder or a DCP step folder."""
    if os.path.isfile(os.path.join(path, "config.json")):
        tensors, config = load_export(path)
        prov_path = os.path.join(path, PROVENANCE_NAME)
        run = _read_json(prov_path).get("run", {}) if os.path.isfile(prov_path) else {}
        name = name or run.get("draft", "").split("/")[0]
        if not name:
            raise ValueError(f"--draft: {path} has no {PROVENANCE_NAME} naming its draft; pass --draft-name")
        spec = get_model_spec(name)
        if spec.from_export_fn is None:
            raise ValueError(f"draft {name!r} cannot be read back from an export")
        args, state = spec.from_export_fn(tensors, config)
        return spec, args, state, run
    if os.path.isfile(os.path.join(path, ".metadata")):
        import torch.distributed.checkpoint as dcp

        dump = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        run = _read_json(os.path.join(dump, RUN_INFO_NAME))
        spec = get_model_spec(name or run["draft"].split("/")[0])
        fields = _read_json(os.path.join(dump, MODEL_ARGS_NAME))
        args = type(next(iter(spec.flavors.values())))(**fields)
        model = spec.model_cls(args)
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=path)
        return spec, args, state["model"], run
    raise ValueError(f"--draft: {path!r} is neither an export folder (config.json) nor a DCP "
                     "checkpoint folder (.metadata)")


class Evaluator:
    """The ``[eval]`` section during training: prompts rendered once at start (so a bad source
    fails before training), the measurement every ``eval.interval`` steps and at the end."""

    def __init__(self, cfg, spec, model_args, target, tokenizer, device: torch.device, reserved_ids=()):
        e = cfg.eval
        self.cfg, self.spec, self.model_args = cfg, spec, model_args
        self.target, self.device = target, device
        self.enabled = e.enable
        if not self.enabled:
            return
        if spec.build_proposer_fn is None:
            raise ValueError(f"eval.enable: draft {spec.name!r} has no proposer (build_proposer_fn)")
        d = cfg.data
        template = resolve_template(d.chat_template, tokenizer)
        self.prompts = load_eval_prompts(
            list(e.prompts), tokenizer, template=template,
            system_prompt=resolve_system_prompt(d.system_prompt, tokenizer, template),
            enable_thinking=d.enable_thinking, num_prompts=e.num_prompts, data_source=d.source,
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
        self.stop_ids = stop_token_ids(tokenizer, template)
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
    for k, rate in enumerate(s["accept_rate"], 1):
        out[f"eval/accept_rate_{k}"] = rate
    for key in ("speculative_tokens_per_s", "greedy_tokens_per_s", "speedup"):
        if s[key] is not None:
            out[f"eval/{key}"] = s[key]
    if s["lossless_prompts"] is not None:
        out["eval/lossless_fraction"] = s["lossless_prompts"] / max(s["num_prompts"], 1)
    return out


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m titan_draft.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HF folder of the target")
    p.add_argument("--draft", required=True, help="export folder or DCP checkpoint step folder")
    p.add_argument("--draft-name", default=None, help="registered draft (default: from the run)")
    p.add_argument("--prompts", default="mtbench", help="comma-separated: mtbench, holdout, or .jsonl paths")
    p.add_argument("--num-prompts", type=int, default=0, help="per source (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="leave out longer prompts (0: keep all)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="target and draft dtype (float32: the lossless check is exact)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--chat-template", default=None, help="default: the training run's")
    p.add_argument("--system-prompt", default=None, help="'auto' (the template's own), text, or '' (default: the training run's)")
    p.add_argument("--enable-thinking", default=None, choices=["true", "false"], help="default: the training run's")
    p.add_argument("--data-source", default=None, help="for 'holdout' (default: the training run's)")
    p.add_argument("--holdout-rows", type=int, default=None, help="for 'holdout' (default: the training run's)")
    p.add_argument("--no-lossless-check", action="store_true", help="skip plain greedy decoding")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="decode eagerly (default on one GPU: the target's decode steps replay as CUDA graphs)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (checked token for token); > 0: speculative sampling (lossless in distribution)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i draws from seed + i)")
    p.add_argument("--proposer-option", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument of the draft's proposer (its build_proposer_fn), repeatable; VALUE "
                        "is read as JSON when it parses (e.g. confidence_threshold=0.5 for DSpark)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    return p.parse_args(argv)


def parse_proposer_options(items: list[str]) -> dict:
    """``["key=value", ...]`` -> keyword arguments (values as JSON where they parse, else text)."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--proposer-option: {item!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def build_proposer(spec, draft, options: dict):
    """The spec's proposer with ``options``; one line naming the draft and the option it refuses."""
    if not options:
        return spec.build_proposer_fn(draft)
    try:
        return spec.build_proposer_fn(draft, **options)
    except TypeError as e:
        raise ValueError(f"--proposer-option: draft {spec.name!r} does not take {sorted(options)}: {e}") from None


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = _parse(sys.argv[1:] if argv is None else argv)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    dtype = getattr(torch, a.dtype)
    try:
        options = parse_proposer_options(a.proposer_option)
        spec, args, state, run = load_draft_source(a.draft, a.draft_name)
        target = load_target(a.target, dtype=dtype, device=device)
        tokenizer = build_tokenizer(a.target)
        template = resolve_template(a.chat_template or run.get("chat_template", "auto"), tokenizer)
        thinking = run.get("enable_thinking", True) if a.enable_thinking is None else a.enable_thinking == "true"
        prompts = load_eval_prompts(
            a.prompts.split(","), tokenizer, template=template,
            system_prompt=resolve_system_prompt(
                run.get("system_prompt", "auto") if a.system_prompt is None else a.system_prompt, tokenizer, template),
            enable_thinking=thinking, num_prompts=a.num_prompts,
            data_source=a.data_source or run.get("data_source", ""),
            holdout_rows=run.get("holdout_rows", 0) if a.holdout_rows is None else a.holdout_rows,
            max_prompt_tokens=a.max_prompt_tokens,
        )
    except ValueError as e:
        print(f"titan_draft.eval: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    draft = build_eval_draft(spec, args, state, target, device, dtype)
    try:
        proposer = build_proposer(spec, draft, options)
    except ValueError as e:
        print(f"titan_draft.eval: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    report = evaluate(target, proposer, prompts, max_new_tokens=a.max_new_tokens,
                      stop_ids=stop_token_ids(tokenizer, template), device=device,
                      check_lossless=not a.no_lossless_check, temperature=a.temperature, seed=a.seed,
                      cuda_graphs=not a.no_cuda_graphs)
    print(report.table())
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"target": a.target, "draft": a.draft, "dtype": a.dtype, "proposer_options": options,
                       **report.to_json()}, f, indent=2)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
