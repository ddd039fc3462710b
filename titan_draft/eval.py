"""True acceptance length: a trained draft decoding next to its real target.

    python -m titan_draft.eval --target outputs/targets/smollm2 --draft outputs/smollm2/export

``--draft`` is an export folder (``config.json`` + ``model.safetensors``, ours or any draft in
the serving contract its spec reads) or a DCP checkpoint ``<dump>/checkpoint/step-N`` (its dump
folder's ``model_args.json`` says what was trained). Prompts are MT-Bench's first turns by
default, rendered with the chat format the draft was trained on. Every prompt is decoded twice,
speculatively and plainly (greedy, KV-cached, batch 1): τ, acceptance per draft position,
tokens/s of both and the lossless check come out as a table and, with ``--out``, as JSON.

During training the ``[eval]`` section runs the same measurement
(``titan_draft.decoding.evaluator.Evaluator``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys
import time
import types
import typing
from collections.abc import Callable

import torch
import torch.distributed as dist

from titan_draft.checkpoint.draft_source import load_draft_source
from titan_draft.components.disk_full import disk_full_line, is_disk_full, write_atomic
from titan_draft.data.chat.format import resolve_chat_format
from titan_draft.data.chat.prompts import load_eval_prompts, stop_token_ids
from titan_draft.data.tokenizer import build_tokenizer
from titan_draft.decoding.acceptance import evaluate
from titan_draft.decoding.eval_target import add_target_backend_arg, load_checked_target, resolve_target_backend
from titan_draft.decoding.evaluator import build_eval_draft
from titan_draft.decoding.greedy_cache import cache_setting, load_greedy_cache, save_greedy_cache
from titan_draft.decoding.round_timing import breakdown_line, round_breakdown

logger = logging.getLogger(__name__)

def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m titan_draft.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HF folder of the target")
    p.add_argument("--draft", required=True, help="export folder or DCP checkpoint step folder")
    p.add_argument("--draft-name", default=None, help="registered draft (default: from the run)")
    p.add_argument("--prompts", default="mtbench", help="comma-separated: mtbench, holdout, or .jsonl paths")
    p.add_argument("--num-prompts", type=int, default=0, help="per source (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="leave out longer prompts (0: keep all)")
    add_target_backend_arg(p)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="target and draft dtype (float32: the lossless check is exact)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument("--chat-template", default=None, help="default: the training run's")
    p.add_argument("--system-prompt", default=None,
                   help="'auto' (the template's own), text, or '' (default: the training run's)")
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
                        "is read as JSON when it parses (DSpark: confidence_threshold=0.5, "
                        "decode_as=specforge_spec_generate)")
    p.add_argument("--greedy-cache", default=None, metavar="FILE",
                   help="T = 0: reuse the plain greedy decodes (and their speed) in FILE made by an eval of "
                        "the same target, dtype and device on this machine since its boot, and add this "
                        "eval's (titan_draft/decoding/greedy_cache.py)")
    p.add_argument("--round-timing", type=int, default=0, metavar="N",
                   help="then decode the first N prompts again with each round's proposal, verify pass and "
                        "commit timed apart (the first prompt as warm-up; titan_draft/decoding/round_timing.py)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.add_argument("--allow-target-mismatch", action="store_true",
                   help="evaluate even when --target differs from the target the export records (its layer "
                        "count, sizes, vocabulary or frozen tables); the differences are logged")
    return p.parse_args(argv)


def check_round_timing(a, num_prompts: int) -> None:
    """``--round-timing N``: greedy, one process, and a prompt to time after the warm-up one."""
    if not a.round_timing:
        return
    if a.temperature > 0:
        raise ValueError("--round-timing times greedy rounds: it needs --temperature 0")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("--round-timing: one process only")
    if not 2 <= a.round_timing <= num_prompts:
        raise ValueError(f"--round-timing {a.round_timing}: needs 2 .. {num_prompts} (the prompts; the first is "
                         "the warm-up)")


def maybe_load_greedy_cache(a, fingerprint: str | None, device: torch.device):
    """``(setting, cache, keys already there)`` for ``--greedy-cache``, or None without it;
    ``fingerprint``: the loaded target's frozen tables (``build_target_record``)."""
    if not a.greedy_cache:
        return None
    if a.temperature > 0 or a.no_lossless_check:
        raise ValueError("--greedy-cache keeps plain greedy decodes: it needs --temperature 0 and the lossless check")
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError("--greedy-cache: one process only (each rank would decode, and write, part of the prompts)")
    setting = cache_setting(a.target, fingerprint, a.dtype, device, not a.no_cuda_graphs)
    cache = load_greedy_cache(a.greedy_cache, setting)
    return setting, cache, set(cache)


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


def _option_types(hint) -> tuple[type, ...]:
    """The plain types an annotation allows (``bool | None`` -> ``(bool, NoneType)``); () when it
    says nothing checkable."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return tuple(a for a in args if isinstance(a, type))


def _accepts(value, allowed: tuple[type, ...]) -> bool:
    if isinstance(value, bool):  # an int to isinstance: only where bool itself is allowed
        return bool in allowed
    if isinstance(value, int) and float in allowed:  # JSON's 0 for a float
        return True
    return isinstance(value, allowed)


def check_proposer_options(spec, options: dict) -> None:
    """Each option's value against the type its proposer annotates (JSON gives bool, int, float,
    str): ``graph_commit=False`` arrives as the text 'False', which would read as true."""
    try:
        params = inspect.signature(spec.build_proposer_fn, eval_str=True).parameters
    except (TypeError, ValueError, NameError):
        return
    named = [n for n, q in params.items() if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)][1:]  # not the draft
    unknown = sorted(set(options) - set(named))
    if unknown and not any(q.kind is q.VAR_KEYWORD for q in params.values()):
        raise ValueError(f"--proposer-option: draft {spec.name!r} does not take {unknown} (it takes {named})")
    for key, value in options.items():
        hint = params[key].annotation if key in params else inspect.Parameter.empty
        allowed = () if hint is inspect.Parameter.empty else _option_types(hint)
        if not allowed:
            continue
        if not _accepts(value, allowed):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"--proposer-option {key}={value!r}: draft {spec.name!r} takes {names} there "
                             "(values are read as JSON: true, false, numbers, null; anything else is text)")


def build_proposer(spec, draft, options: dict):
    """The spec's proposer with ``options``; one line naming the draft and the option it refuses."""
    if not options:
        return spec.build_proposer_fn(draft)
    check_proposer_options(spec, options)
    try:
        return spec.build_proposer_fn(draft, **options)
    except TypeError as e:
        raise ValueError(f"--proposer-option: draft {spec.name!r} does not take {sorted(options)}: {e}") from None


def resolve_device(spec: str) -> torch.device:
    """``auto``: the GPU where there is one, else the CPU; any other value names the device."""
    if spec != "auto":
        return torch.device(spec)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def build_run_prompts(run: dict, tokenizer, sources: str, num_prompts: int, *, chat_template: str | None = None,
                      system_prompt: str | None = None, enable_thinking: bool | None = None,
                      data_source: str | None = None, holdout_rows: int | None = None, max_prompt_tokens: int = 0,
                      key: str = "--chat-template"):
    """``(chat format, prompts)``: the training run's chat format and held-out rows (``run``, an
    export's run info) wherever the caller gives none, and the prompts of ``sources`` (comma-separated)
    rendered in that format. ``key`` names the template's source in an error."""
    chat = resolve_chat_format(
        tokenizer, template=chat_template or run.get("chat_template", "auto"),
        system_prompt=run.get("system_prompt", "auto") if system_prompt is None else system_prompt,
        enable_thinking=run.get("enable_thinking", True) if enable_thinking is None else enable_thinking, key=key)
    prompts = load_eval_prompts(
        sources.split(","), tokenizer, template=chat.template, system_prompt=chat.system_prompt,
        enable_thinking=chat.enable_thinking, num_prompts=num_prompts,
        data_source=data_source or run.get("data_source", ""),
        holdout_rows=run.get("holdout_rows", 0) if holdout_rows is None else holdout_rows,
        max_prompt_tokens=max_prompt_tokens)
    return chat, prompts


def build_progress_line(started: float) -> Callable:
    """``evaluate``'s progress: one line on stderr at every tenth of this rank's prompts and at its
    last (all 80 MT-Bench questions in fp32 on a CPU take most of an hour); rank 0 only."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    whose = "" if world == 1 else " (rank 0's)"

    def progress(reports: list, planned: int) -> None:
        done = len(reports)
        if (world > 1 and dist.get_rank() != 0) or (done % max(1, planned // 10) and done != planned):
            return
        rounds = sum(r.rounds for r in reports)
        tau = sum(r.round_tokens for r in reports) / max(rounds, 1)
        checked = [r.lossless for r in reports if r.lossless is not None]
        lossless = f", lossless {sum(checked)}/{len(checked)}" if checked else ""
        print(f"titan_draft.eval: {done}/{planned} prompts{whose} decoded, tau so far {tau:.3f} over {rounds} rounds"
              f"{lossless}, {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    return progress


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = _parse(sys.argv[1:] if argv is None else argv)
    device = resolve_device(a.device)
    dtype = getattr(torch, a.dtype)
    try:
        options = parse_proposer_options(a.proposer_option)
        spec, args, state, run = load_draft_source(a.draft, a.draft_name)
        target, fingerprint = load_checked_target(
            a.target, [a.draft], dtype=dtype, device=device,
            backend=resolve_target_backend(a.target_backend, [run]),
            allow_mismatch=a.allow_target_mismatch, fingerprint=bool(a.greedy_cache))
        tokenizer = build_tokenizer(a.target)
        chat, prompts = build_run_prompts(
            run, tokenizer, a.prompts, a.num_prompts, chat_template=a.chat_template, system_prompt=a.system_prompt,
            enable_thinking=None if a.enable_thinking is None else a.enable_thinking == "true",
            data_source=a.data_source, holdout_rows=a.holdout_rows, max_prompt_tokens=a.max_prompt_tokens)
        greedy = maybe_load_greedy_cache(a, fingerprint, device)
        check_round_timing(a, len(prompts))
    except ValueError as e:
        print(f"titan_draft.eval: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    draft = build_eval_draft(spec, args, state, target, device, dtype)
    try:
        proposer = build_proposer(spec, draft, options)
    except ValueError as e:
        print(f"titan_draft.eval: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    stop_ids = stop_token_ids(tokenizer, chat.template)
    report = evaluate(target, proposer, prompts, max_new_tokens=a.max_new_tokens, stop_ids=stop_ids, device=device,
                      check_lossless=not a.no_lossless_check, temperature=a.temperature, seed=a.seed,
                      cuda_graphs=not a.no_cuda_graphs, greedy_cache=greedy[1] if greedy else None,
                      progress=build_progress_line(time.monotonic()))
    print(report.table())
    rounds = None
    if a.round_timing:
        rounds = round_breakdown(target, proposer, prompts[: a.round_timing], max_new_tokens=a.max_new_tokens,
                                 stop_ids=stop_ids, device=device, cuda_graphs=not a.no_cuda_graphs)
        print(breakdown_line(rounds))
    reused = 0
    if greedy:
        reused = len(greedy[2] & {(tuple(p.ids), a.max_new_tokens, tuple(sorted(stop_ids))) for p in prompts})
        print(f"plain greedy: {reused} of {len(prompts)} prompts from {a.greedy_cache} (decoded there before, "
              "their speed too)")
    if a.out:
        try:
            write_atomic(a.out, json.dumps({"target": a.target, "draft": a.draft, "dtype": a.dtype,
                                            "proposer_options": options, "proposer_settings": proposer.settings,
                                            "greedy_from_cache": reused,
                                            **report.to_json(), **({"round_ms": rounds} if rounds else {})},
                                           indent=2))
        except OSError as e:
            if not is_disk_full(e):
                raise
            print(f"titan_draft.eval: error: writing {a.out} failed: {disk_full_line(a.out)}; the table above "
                  "is the whole report", file=sys.stderr)
            raise SystemExit(1) from None
    if greedy:
        try:
            save_greedy_cache(a.greedy_cache, greedy[0], greedy[1])
        except OSError as e:  # the report is written; only the next eval's saving is lost
            print(f"titan_draft.eval: warning: --greedy-cache {a.greedy_cache} not written: "
                  f"{disk_full_line(a.greedy_cache) if is_disk_full(e) else e}", file=sys.stderr)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
