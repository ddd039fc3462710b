"""Decode settings of one export against its target, side by side: true tau, speculative and plain
tokens/s and their ratio, and where a round's time goes, for every combination of proposer options.

    python scripts/sweep_decode.py --target outputs/targets/smollm2 --draft outputs/eagle3_smollm2/export \\
        --dtype bfloat16 --num-prompts 40 --option num_draft_tokens=2,3,4 --round-timing 5

A draft trains for one proposal length, but the one that serves fastest depends on the target's
verify cost against the draft's per-token cost (a 135M target verifies 8 tokens in about the time
of one greedy step; an 8B one does not). Each setting is one greedy ``python -m titan_draft.eval``
(lossless-checked); all share one greedy cache (``<out>/greedy_<dtype>.json``), so the plain
decodes run once, in the first, and the later settings only decode speculatively. The first row is
the proposer's defaults; then every combination of the ``--option`` values. Writes
``<out>/sweep.md`` and ``<out>/sweep.json``; each eval's log and JSON stay in ``<out>``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import shlex
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # runnable from a checkout without an install
    sys.path.insert(0, REPO)

from scripts.compare.jobs import Interrupted, last_line, run_logged  # noqa: E402


class SweepError(Exception):
    pass


def parse_options(items: list[str]) -> list[tuple[str, list[str]]]:
    """``["KEY=V1,V2", ...]`` -> ``[(KEY, [V1, V2]), ...]`` (values as the eval reads them)."""
    out = []
    for item in items:
        key, sep, values = item.partition("=")
        vals = [v for v in values.split(",") if v]
        if not sep or not key.isidentifier() or not vals:
            raise SweepError(f"--option {item!r}: expected KEY=V1[,V2...]")
        if key in dict(out):
            raise SweepError(f"--option {key}: given twice (list its values in one --option)")
        out.append((key, vals))
    return out


def settings(options: list[tuple[str, list[str]]]) -> list[list[str]]:
    """The defaults (no option), then every combination: each a list of ``KEY=VALUE``."""
    combos = [[f"{k}={v}" for (k, _), v in zip(options, values)]
              for values in itertools.product(*(vals for _, vals in options))] if options else []
    return [[]] + combos


def check_settings(a, grid: list[list[str]]) -> None:
    """Every setting against the draft's proposer before anything is decoded: a bad value in the
    last setting must not wait for the first ones' decodes."""
    from titan_draft.checkpoint.draft_source import draft_spec
    from titan_draft.eval import check_proposer_options, parse_proposer_options

    try:
        spec = draft_spec(a.draft, None)
    except ValueError as e:
        raise SweepError(str(e)) from None
    for setting in grid:
        try:
            check_proposer_options(spec, parse_proposer_options(setting))
        except ValueError as e:
            raise SweepError(f"{' '.join(setting)}: {e}") from None


def eval_command(a, setting: list[str], out_json: str) -> list[str]:
    cmd = [sys.executable, "-m", "titan_draft.eval", "--target", a.target, "--draft", a.draft,
           "--prompts", a.prompts, "--num-prompts", str(a.num_prompts), "--max-new-tokens", str(a.max_new_tokens),
           "--dtype", a.dtype, "--device", a.device, "--greedy-cache", os.path.join(a.out, f"greedy_{a.dtype}.json"),
           "--out", out_json]
    for item in setting:
        cmd += ["--proposer-option", item]
    if a.round_timing:
        cmd += ["--round-timing", str(a.round_timing)]
    return cmd


def run_setting(a, i: int, setting: list[str]) -> dict:
    """One eval; its report's row, or SweepError with the eval's own error line (bad input)."""
    out_json, log_path = (os.path.join(a.out, f"setting_{i}{ext}") for ext in (".json", ".log"))
    rc, _ = run_logged(eval_command(a, setting, out_json), log_path)
    label = " ".join(setting) or "defaults"
    if rc != 0:
        last = last_line(log_path)
        if rc == 2:  # the eval refused its input: the same for every setting that has it
            raise SweepError(f"{label}: {last}")
        return {"setting": label, "error": f"exit {rc}: {last} (log {log_path})"}
    with open(out_json) as f:
        report = json.load(f)
    s = report["summary"]
    return {"setting": label, "tau": s["tau"], "proposed_per_round": s["proposed_per_round"],
            "speculative_tokens_per_s": s["speculative_tokens_per_s"], "plain_tokens_per_s": s["greedy_tokens_per_s"],
            "ratio": s["speedup"], "lossless": f"{s['lossless_prompts']}/{s['num_prompts']}",
            "plain_from_cache": report["greedy_from_cache"], "round_ms": report.get("round_ms")}


def table(a, rows: list[dict]) -> str:
    lines = ["# Decode settings", "",
             f"{a.draft} against {a.target}, {a.prompts} (first {a.num_prompts or 'all'}), {a.max_new_tokens} new "
             f"tokens, greedy, {a.dtype}, {a.device}. Date {datetime.date.today()}.", "",
             "| setting | tau | proposed a round | speculative tok/s | plain tok/s | ratio | lossless | "
             "proposal / verify / commit / loop ms a round |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setting']} | {r['error']} | | | | | | |")
            continue
        rt = r["round_ms"]
        phases = " / ".join(f"{rt[k]:.2f}" for k in ("proposal", "verify", "commit", "loop")) if rt else "–"
        lines.append(f"| {r['setting']} | {r['tau']:.3f} | {r['proposed_per_round']:.2f} | "
                     f"{r['speculative_tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | {r['ratio']:.2f}x | "
                     f"{r['lossless']} | {phases} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target HF folder")
    p.add_argument("--draft", required=True, help="export folder (or DCP step folder)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=V1[,V2...]",
                   help="a proposer option and its values (repeatable; every combination is run)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--prompts", default="mtbench")
    p.add_argument("--num-prompts", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--round-timing", type=int, default=0, metavar="N", help="as titan_draft.eval's")
    p.add_argument("--out", default="outputs/sweep_decode")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        grid = settings(parse_options(a.option))
        check_settings(a, grid)
        os.makedirs(a.out, exist_ok=True)
        rows = []
        for i, setting in enumerate(grid):
            rows.append(run_setting(a, i, setting))
            print(f"sweep_decode: {rows[-1]['setting']}: " + (rows[-1].get("error") or
                  f"tau {rows[-1]['tau']:.3f}, {rows[-1]['ratio']:.2f}x plain"), flush=True)
    except SweepError as e:
        print(f"sweep_decode: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except Interrupted:
        print("sweep_decode: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    with open(os.path.join(a.out, "sweep.json"), "w") as f:
        json.dump({"command": shlex.join(["python", "scripts/sweep_decode.py", *(argv or sys.argv[1:])]),
                   "rows": rows}, f, indent=2)
    text = table(a, rows)
    with open(os.path.join(a.out, "sweep.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
