"""Where a draft's acceptance goes at T > 0: its first drafted token along the target's greedy and
sampled decodes, teacher-forced, by how certain the target is.

    python scripts/first_token.py --target outputs/targets/smollm2 --draft outputs/eagle3_smollm2/export \\
        --contexts 0,1 --temperature 1 [--prompts mtbench --num-prompts 0 --max-new-tokens 256 --out first.json]

Speculative sampling accepts a draft with probability ``sum_v min(p_v, q_v)``. A draft keeps less of
its greedy tau at T = 1 either because that rule is harder than matching an argmax, or because the
sampled contexts are ones it predicts worse (and the target is less certain in them). This decodes
each eval prompt plainly at every ``--contexts`` temperature (0: greedy; T > 0 samples with seed
``--seed`` + i for prompt i, as the eval and ``vocab_mass.py`` do), then runs the draft's round at
every decoded position (``titan_draft/decoding/first_token.py``) and reports, per context, the
first draft's acceptance at ``--temperature``, its argmax agreement with the target's, and the
target's own top-1 probability and entropy, overall and by buckets of that top-1 probability. Any
draft whose proposer hands over its sampling distribution (all three) can be read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.read_args import add_read_args, parse_temperatures  # noqa: E402
from titan_draft.checkpoint.draft_source import load_draft_source  # noqa: E402
from titan_draft.data.chat.prompts import stop_token_ids  # noqa: E402
from titan_draft.data.tokenizer import build_tokenizer  # noqa: E402
from titan_draft.decoding.eval_target import load_checked_target, resolve_target_backend  # noqa: E402
from titan_draft.decoding.evaluator import build_eval_draft  # noqa: E402
from titan_draft.decoding.first_token import TOP1_EDGES as EDGES  # noqa: E402
from titan_draft.decoding.first_token import forced_first_tokens, top1_bucket  # noqa: E402
from titan_draft.decoding.sampling import plain_decode  # noqa: E402
from titan_draft.eval import build_proposer, build_run_prompts, parse_proposer_options, resolve_device  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python scripts/first_token.py", description=__doc__.split("\n\n")[0])
    add_read_args(p, draft_help="an export folder (or a DCP step folder, with --draft-name)")
    p.add_argument("--draft-name", default=None, help="draft name where the folder does not record it")
    p.add_argument("--contexts", default="0,1", help="comma-separated temperatures of the decodes read (0: greedy)")
    p.add_argument("--temperature", type=float, default=1.0, help="the acceptance rule's temperature (> 0)")
    p.add_argument("--proposer-option", action="append", default=[], metavar="KEY=VALUE",
                   help="as titan_draft.eval takes them; e.g. EAGLE-3's num_draft_tokens=1: only the first "
                        "token is read, and a chain of one costs a seventh of the default")
    p.add_argument("--out", default=None, help="JSON: the figures, and every position's terms per context")
    a = p.parse_args(argv)
    a.contexts = parse_temperatures(a.contexts, "--contexts", "first_token")
    if a.temperature <= 0 or a.max_new_tokens < 2:
        raise SystemExit("first_token: error: --temperature must be > 0 and --max-new-tokens >= 2")
    return a


def _mean(xs) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize(terms: dict[str, list]) -> dict:
    """Means over all positions and per bucket of the target's top-1 probability."""
    top1 = terms["target_top1"]
    out = {"positions": len(top1), **{k: _mean([float(x) for x in v]) for k, v in terms.items()}, "buckets": []}
    buckets = [top1_bucket(x) for x in top1]
    for k, (lo, hi) in enumerate(zip(EDGES, EDGES[1:])):
        rows = [i for i, b in enumerate(buckets) if b == k]
        out["buckets"].append({"target_top1": [lo, hi], "positions": len(rows),
                               "accept": _mean([terms["accept"][i] for i in rows]),
                               "argmax_match": _mean([float(terms["argmax_match"][i]) for i in rows])})
    return out


def render(result: dict) -> str:
    t = result["temperature"]
    lines = [f"| decodes | positions | first draft accepted at T={t:g} | argmax agrees | target top-1 | "
             "target entropy (nats) |", "| --- | --- | --- | --- | --- | --- |"]
    for c, s in result["contexts"].items():
        lines.append(f"| T={c} | {s['positions']} | {s['accept']:.3f} | {s['argmax_match']:.3f} | "
                     f"{s['target_top1']:.3f} | {s['target_entropy']:.3f} |")
    lines += ["", "By the target's top-1 probability (first draft accepted / argmax agrees, positions):", "",
              "| target top-1 | " + " | ".join(f"T={c} decodes" for c in result["contexts"]) + " |",
              "| --- |" + " --- |" * len(result["contexts"])]
    for k, (lo, hi) in enumerate(zip(EDGES, EDGES[1:])):
        cells = []
        for s in result["contexts"].values():
            b = s["buckets"][k]
            cells.append("–" if not b["positions"] else
                         f"{b['accept']:.3f} / {b['argmax_match']:.3f} ({b['positions']})")
        lines.append(f"| {lo:g}-{hi:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    device, dtype = resolve_device(a.device), getattr(torch, a.dtype)
    try:
        spec, args, state, run = load_draft_source(a.draft, a.draft_name)
        target, _ = load_checked_target(a.target, [a.draft], dtype=dtype, device=device,
                                        backend=resolve_target_backend(a.target_backend, [run]),
                                        allow_mismatch=a.allow_target_mismatch)
        tokenizer = build_tokenizer(a.target)
        chat, prompts = build_run_prompts(run, tokenizer, a.prompts, a.num_prompts, key="the draft's chat_template")
        options = parse_proposer_options(a.proposer_option)
        proposer = build_proposer(spec, build_eval_draft(spec, args, state, target, device, dtype), options)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"first_token: error: {e}") from None
    stop = stop_token_ids(tokenizer, chat.template)
    result = {"target": a.target, "draft": a.draft, "temperature": a.temperature, "contexts": {}, "decodes": {}}
    for c in a.contexts:
        terms = {"accept": [], "argmax_match": [], "target_top1": [], "target_entropy": []}
        decodes = []
        for i, prompt in enumerate(prompts):
            gen = plain_decode(target, prompt.ids, a.max_new_tokens, stop, device, temperature=c, seed=a.seed + i)
            first = forced_first_tokens(target, proposer, prompt.ids, gen.tokens, device, temperature=a.temperature,
                                        generator=torch.Generator().manual_seed(a.seed + i))
            decodes.append({"name": prompt.name, "prompt_ids": prompt.ids, "tokens": gen.tokens, **vars(first)})
            for k in terms:
                terms[k] += getattr(first, k)
        result["contexts"][f"{c:g}"] = summarize(terms)
        result["decodes"][f"{c:g}"] = decodes
        s = result["contexts"][f"{c:g}"]
        print(f"T={c:g} decodes of {len(prompts)} prompts, {s['positions']} positions: first draft accepted "
              f"{s['accept']:.3f} at T={a.temperature:g}, argmax agrees {s['argmax_match']:.3f}, target top-1 "
              f"{s['target_top1']:.3f}, entropy {s['target_entropy']:.3f}", flush=True)
    print(render(result))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
