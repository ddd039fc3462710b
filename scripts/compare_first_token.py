"""Several drafts' first drafted tokens read at the same positions, side by side: how often each is
accepted by how sure the target is there, and each against a reference, paired on the prompts.

Reads reports of ``scripts/first_token.py --out``, one per draft, all made along the same target
decodes (same prompts, new tokens and seed: the decodes are the target's, so every draft is read
at the very same positions). ::

    python scripts/compare_first_token.py --reference soft soft=first_soft.json argmax=first_argmax.json \\
        --context 1 --mix greedy=first_c0.json:0

For each bucket of the target's top-1 probability (and over all positions) it prints each draft's
acceptance Σ min(p, q) and argmax agreement, and each other draft's acceptance less the
reference's with a bootstrap interval over prompts (the same paired bootstrap as
``compare_evals.py``: one set of resampled prompts for both drafts).

``--mix NAME=REPORT:CONTEXT`` answers what a difference would be where the target is as sure as
it is along other decodes (say its greedy ones): each bucket's difference weighted by the share of
that report's positions in the bucket, paired as above. A draft that gains where the target is
unsure and loses where it is sure can gain at T = 1 and nothing greedily; this shows it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.compare.report import format_difference, write_markdown  # noqa: E402
from titan_draft.decoding.first_token import TOP1_EDGES as EDGES  # noqa: E402
from titan_draft.decoding.first_token import top1_bucket  # noqa: E402
from titan_draft.decoding.tau_interval import paired_contrast, paired_difference  # noqa: E402


class CompareError(ValueError):
    """Reports that cannot be compared; the message names the report and why."""


def read_decodes(path: str, context: str) -> list[dict]:
    """The per-position terms of ``path``'s decodes at ``context`` (a temperature, as written)."""
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CompareError(f"{path}: cannot read a first_token report ({e})") from None
    decodes = report.get("decodes") if isinstance(report, dict) else None
    if not isinstance(decodes, dict):
        raise CompareError(f"{path}: not a first_token report (write one with scripts/first_token.py --out)")
    if context not in decodes:
        raise CompareError(f"{path}: no decodes at context {context} (it has {', '.join(decodes) or 'none'})")
    for d in decodes[context]:
        n = len(d.get("target_top1", []))
        if "tokens" not in d or any(len(d.get(k, [])) != n for k in ("accept", "argmax_match")):
            raise CompareError(f"{path}: decode {d.get('name')!r} does not hold one term per position")
    return decodes[context]


def load(items: list[str], context: str) -> dict[str, list[dict]]:
    """``{label: decodes}`` from ``LABEL=PATH`` items; every report must have read the same positions."""
    out: dict[str, list[dict]] = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise CompareError(f"{item!r}: expected LABEL=PATH")
        if label in out:
            raise CompareError(f"{label}: given twice")
        out[label] = read_decodes(path, context)
    first, ref = next(iter(out.items()))
    for label, decodes in out.items():
        if [(d["name"], d["tokens"]) for d in decodes] != [(d["name"], d["tokens"]) for d in ref]:
            raise CompareError(f"{label} and {first} were not read at the same positions (other prompts, "
                               "lengths or seeds: make both along the same target decodes)")
    return out


def bucket_of(x: float, edges) -> int:
    k = top1_bucket(x, edges)
    if k is None:
        raise CompareError(f"target top-1 {x} outside the buckets {edges[0]}..{edges[-1]}")
    return k


def bucket_ids(decodes: list[dict], edges) -> list[list[int]]:
    """Each prompt's positions' buckets, worked out once for every term, bucket and mix read."""
    return [[bucket_of(x, edges) for x in d["target_top1"]] for d in decodes]


def per_prompt(decodes: list[dict], term: str, k: int | None, ids: list[list[int]]) -> list[dict]:
    """Per prompt: the sum of ``term`` over its positions in bucket ``k`` (``ids``; all with None)
    and their count, as ``round_tokens`` / ``rounds``, so the paired bootstrap of tau_interval
    applies (its figure is a ratio of sums over prompts, as an acceptance over positions is)."""
    out = []
    for d, buckets in zip(decodes, ids):
        rows = [i for i, b in enumerate(buckets) if k is None or b == k]
        out.append({"name": d["name"], "round_tokens": sum(float(d[term][i]) for i in rows), "rounds": len(rows)})
    return out


def _mean(prompts: list[dict]) -> float | None:
    n = sum(p["rounds"] for p in prompts)
    return sum(p["round_tokens"] for p in prompts) / n if n else None


def build_table(reports: dict[str, list[dict]], reference: str, ids: dict[str, list[list[int]]],
                edges=EDGES) -> dict:
    """One row per bucket and one over all positions: positions, each label's acceptance and argmax
    agreement, each other label's acceptance less the reference's (paired); ``ids``: each label's
    :func:`bucket_ids`."""
    if reference not in reports:
        raise CompareError(f"--reference {reference!r} is not one of the labels ({', '.join(reports)})")
    rows = []
    for k in [*range(len(edges) - 1), None]:
        accept = {x: per_prompt(d, "accept", k, ids[x]) for x, d in reports.items()}
        n = sum(p["rounds"] for p in accept[reference])
        row = {"bucket": "all" if k is None else [edges[k], edges[k + 1]], "positions": n, "labels": {}}
        for x, d in reports.items():
            cell = {"accept": _mean(accept[x]), "argmax_match": _mean(per_prompt(d, "argmax_match", k, ids[x]))}
            if x != reference and n:
                cell["vs_reference"] = paired_difference(accept[x], accept[reference])
            row["labels"][x] = cell
        rows.append(row)
    return {"reference": reference, "edges": list(edges), "rows": rows}


def mix_weights(spec: str, edges=EDGES) -> tuple[str, list[float]]:
    """``NAME=REPORT:CONTEXT`` -> (NAME, each bucket's share of that report's positions there)."""
    name, sep, rest = spec.partition("=")
    path, sep2, context = rest.rpartition(":")
    if not sep or not sep2 or not name or not path:
        raise CompareError(f"--mix {spec!r}: expected NAME=REPORT:CONTEXT")
    counts = [0] * (len(edges) - 1)
    for buckets in bucket_ids(read_decodes(path, context), edges):
        for k in buckets:
            counts[k] += 1
    if not sum(counts):
        raise CompareError(f"--mix {spec!r}: the report has no positions")
    return name, [c / sum(counts) for c in counts]


def reweighted(reports: dict[str, list[dict]], reference: str, ids: dict[str, list[list[int]]], name: str,
               weights: list[float], edges=EDGES) -> dict:
    """Each label's acceptance with its buckets weighted by ``weights``, and each other label's
    difference from the reference so weighted, paired on the prompts (one resample for all buckets)."""
    accept = {x: [per_prompt(d, "accept", k, ids[x]) for k in range(len(weights))] for x, d in reports.items()}
    empty = [k for k, w in enumerate(weights) if w > 0 and not any(p["rounds"] for p in accept[reference][k])]
    if empty:
        raise CompareError(f"--mix {name}: bucket(s) {', '.join(str(edges[k]) for k in empty)} have positions "
                           "there but none in the reports compared: nothing to weight")
    out = {"mix": name, "weights": weights, "labels": {}}
    for x in reports:
        cell = {"accept": sum(w * _mean(b) for w, b in zip(weights, accept[x]) if w > 0)}
        if x != reference:
            evals, ws = [], []
            for w, bx, br in zip(weights, accept[x], accept[reference]):
                if w > 0:
                    evals += [bx, br]
                    ws += [w, -w]
            cell["vs_reference"] = paired_contrast(evals, ws)
        out["labels"][x] = cell
    return out


def render(table: dict, mixes: list[dict]) -> str:
    labels = list(table["rows"][0]["labels"])
    ref = table["reference"]
    others = [x for x in labels if x != ref]
    head = ["target top-1", "positions"] + [f"{x}: accepted / argmax agrees" for x in labels] + \
        [f"{x} − {ref}, accepted (paired)" for x in others]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]

    def f(v):
        return "–" if v is None else f"{v:.3f}"
    for row in table["rows"]:
        b = row["bucket"]
        cells = ["all" if b == "all" else f"{b[0]:g}-{b[1]:g}", str(row["positions"])]
        cells += [f"{f(row['labels'][x]['accept'])} / {f(row['labels'][x]['argmax_match'])}" for x in labels]
        cells += [format_difference(row["labels"][x].get("vs_reference")) for x in others]
        lines.append("| " + " | ".join(cells) + " |")
    for m in mixes:
        shares = ", ".join(f"{w:.2f}" for w in m["weights"])
        cells = [f"weighted as {m['mix']} ({shares})", "–"]
        cells += [f"{m['labels'][x]['accept']:.3f} / –" for x in labels]
        cells += [format_difference(m["labels"][x]["vs_reference"]) for x in others]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python scripts/compare_first_token.py", description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", metavar="LABEL=PATH", help="a first_token.py report, one per draft")
    p.add_argument("--reference", default=None, help="the label every other is paired against (default: the first)")
    p.add_argument("--context", default="1", help="which decodes of the reports to read (their temperature, as "
                                                 "first_token.py wrote it: 0 greedy, 1 ...)")
    p.add_argument("--mix", action="append", default=[], metavar="NAME=REPORT:CONTEXT",
                   help="also weight each bucket by that report's share of positions there (repeatable)")
    p.add_argument("--out", default=None, help="write the markdown here, and the figures as JSON beside it")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        reports = load(a.reports, a.context)
        ids = {x: bucket_ids(d, EDGES) for x, d in reports.items()}
        table = build_table(reports, a.reference or next(iter(reports)), ids)
        mixes = [reweighted(reports, table["reference"], ids, *mix_weights(spec)) for spec in a.mix]
    except CompareError as e:
        print(f"compare_first_token: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    table["mixes"] = mixes
    text = render(table, mixes)
    write_markdown(a.out, text, table)
    print(text, end="")
    return table


if __name__ == "__main__":
    main()
