"""Put finished eval reports side by side: each one's tau with its interval at each temperature,
and each against a reference decoded on the same prompts, paired.

For ablations run by hand (several training jobs, each exported and decoded with
``python -m titan_draft.eval --out R.json``); ``scripts/compare_drafts.py`` writes the same table
for the jobs it trains itself. ::

    python scripts/compare_evals.py --reference default \\
        default=runs/default_t0.json default=runs/default_t1.json \\
        gated=runs/gated_t0.json gated=runs/gated_t1.json

Each ``LABEL=PATH`` is one report; a label's reports are told apart by the temperature they were
decoded at (read from the report). Prints a markdown table (``--out`` writes it, with a ``.json``
beside it).

``--diff-in-diff A1,A0,B1,B0`` asks whether a change helps one draft more than another (say, twice
the steps for DSpark against the same for DFlash2): (τ A1 − τ A0) − (τ B1 − τ B0), paired on the
prompts at each temperature where all four were decoded, in a second table.

``--across-seeds A1+A2,B1+B2`` compares two drafts each trained with several seeds (a label per
seed): the mean of each draft's seeds, their range, and the order called only where every pairing
of an A seed with a B seed is established on the prompts (a second training run moves tau by
more than the prompt bootstrap can see).

``--by-category`` splits the prompts by kind (MT-Bench's eight categories, ten questions each;
other prompts by their source, ``holdout``, ...): each label's tau per category and its paired
difference from the reference there, to tell a draft that is behind everywhere from one that
leads on some kinds of prompt (say, code and math) and trails on others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.compare.report import (  # noqa: E402
    format_difference,
    format_positions,
    render_across_seeds,
    write_markdown,
)
from titan_draft.data.chat.prompts import mtbench_categories  # noqa: E402
from titan_draft.decoding.tau_interval import (  # noqa: E402
    PromptMismatch,
    across_seeds,
    paired_contrast,
    paired_difference,
    tau_interval,
)


class CompareError(ValueError):
    """Reports that cannot be put in one table; the message names the report and why."""


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            report = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CompareError(f"{path}: cannot read an eval report ({e})") from None
    if not isinstance(report, dict) or "summary" not in report or not report.get("prompts") or \
            any("round_tokens" not in p or "rounds" not in p for p in report["prompts"]):
        raise CompareError(f"{path}: not an eval report with per-prompt rounds "
                           "(write one with python -m titan_draft.eval --out)")
    missing = [k for k in ("temperature", "max_new_tokens", "accept_rate") if k not in report["summary"]]
    if missing:
        raise CompareError(f"{path}: the report's summary lacks {', '.join(missing)} (written by an older eval?)")
    return report


def load_reports(items: list[str]) -> dict[str, dict[str, dict]]:
    """``{label: {temperature: report}}`` from ``LABEL=PATH`` items, in the order given."""
    out: dict[str, dict[str, dict]] = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise CompareError(f"{item!r}: expected LABEL=PATH")
        report = _read(path)
        t = f"{float(report['summary']['temperature']):g}"
        if t in out.setdefault(label, {}):
            raise CompareError(f"{label}: two reports at T = {t} ({path} and an earlier one)")
        report["path"] = path
        out[label][t] = report
    return out


def _check_comparable(reports: dict[str, dict[str, dict]]) -> None:
    """Reports at one temperature must have drafted the same number of new tokens a prompt."""
    for t in sorted({t for by_t in reports.values() for t in by_t}, key=float):
        seen = {label: by_t[t]["summary"]["max_new_tokens"] for label, by_t in reports.items() if t in by_t}
        if len(set(seen.values())) > 1:
            raise CompareError(f"at T = {t} the reports decoded different lengths (max_new_tokens "
                               + ", ".join(f"{k} {v}" for k, v in seen.items()) + ")")


def build_table(reports: dict[str, dict[str, dict]], reference: str) -> dict:
    """Every report's tau and interval, and its paired difference from ``reference`` at the same
    temperature (``not_paired`` names why where the prompts differ)."""
    if reference not in reports:
        raise CompareError(f"--reference {reference!r} is not one of the labels ({', '.join(reports)})")
    _check_comparable(reports)
    temps = sorted({t for by_t in reports.values() for t in by_t}, key=float)
    rows = []
    for label, by_t in reports.items():
        row = {"label": label, "evals": {}}
        for t, rep in by_t.items():
            s = rep["summary"]
            cell = {"path": rep["path"], "interval": tau_interval(rep["prompts"]), "accept_rate": s["accept_rate"],
                    "lossless": (f"{s['lossless_prompts']}/{s['num_prompts']}"
                                 if s.get("lossless_prompts") is not None else None)}
            ref = reports[reference].get(t)
            if ref is not None and label != reference:
                try:
                    cell["vs_reference"] = paired_difference(rep["prompts"], ref["prompts"])
                except PromptMismatch as e:
                    cell["vs_reference"] = {"not_paired": str(e)}
            row["evals"][t] = cell
        rows.append(row)
    return {"reference": reference, "temperatures": temps, "rows": rows}


def diff_in_diff(reports: dict[str, dict[str, dict]], spec: str) -> list[dict]:
    """``(A1 - A0) - (B1 - B0)`` for ``spec`` = "A1,A0,B1,B0", one entry per temperature at which all
    four labels were decoded (``not_paired`` names why where their prompts differ)."""
    labels = [x.strip() for x in spec.split(",")]
    if len(labels) != 4 or not all(labels):
        raise CompareError(f"--diff-in-diff {spec!r}: expected four labels A1,A0,B1,B0")
    return _at_shared_temperatures(
        reports, f"--diff-in-diff {spec!r}", labels, "all four", {"labels": labels},
        lambda t: paired_contrast([reports[x][t]["prompts"] for x in labels], [1.0, -1.0, -1.0, 1.0]))


def _at_shared_temperatures(reports, option: str, labels: list[str], which: str, head: dict, compare) -> list[dict]:
    """``head`` plus ``compare(t)`` at each temperature where every one of ``labels`` was decoded
    (``not_paired`` names why where their prompts differ); one line for an unknown label."""
    unknown = [x for x in labels if x not in reports]
    if unknown:
        raise CompareError(f"{option}: {', '.join(unknown)} not among the labels ({', '.join(reports)})")
    temps = sorted(set.intersection(*(set(reports[x]) for x in labels)), key=float)
    if not temps:
        raise CompareError(f"{option}: no temperature at which {which} were decoded")
    out = []
    for t in temps:
        entry = {**head, "temperature": t}
        try:
            entry.update(compare(t))
        except PromptMismatch as e:
            entry["not_paired"] = str(e)
        out.append(entry)
    return out


def compare_across_seeds(reports: dict[str, dict[str, dict]], spec: str) -> list[dict]:
    """Draft A's seeds against draft B's for ``spec`` = "A1+A2,B1+B2", one entry per temperature at
    which every one of those labels was decoded (``not_paired`` names why where prompts differ)."""
    arms = [[x.strip() for x in arm.split("+")] for arm in spec.split(",")]
    if len(arms) != 2 or not all(all(arm) for arm in arms):
        raise CompareError(f"--across-seeds {spec!r}: expected two drafts' seed labels, A1+A2,B1+B2")
    labels = arms[0] + arms[1]
    if len(set(labels)) != len(labels):
        raise CompareError(f"--across-seeds {spec!r}: a label appears twice")
    return _at_shared_temperatures(
        reports, f"--across-seeds {spec!r}", labels, "all of them", {"a": arms[0], "b": arms[1]},
        lambda t: across_seeds(*([reports[x][t]["prompts"] for x in arm] for arm in arms)))


def prompt_category(name: str, mtbench: dict[str, str]) -> str:
    """An eval prompt's kind: its MT-Bench category, else its source (``holdout:17`` -> holdout)."""
    return mtbench.get(name) or name.rsplit(":", 1)[0]


def by_category(reports: dict[str, dict[str, dict]], reference: str) -> list[dict]:
    """Per temperature and prompt kind: every label's tau there and, paired on that kind's prompts,
    its difference from ``reference``. Categories are read from the installed MT-Bench package only
    when a report holds MT-Bench prompts."""
    names = {p["name"] for by_t in reports.values() for rep in by_t.values() for p in rep["prompts"]}
    mtbench = mtbench_categories() if any(n.startswith("mtbench:") for n in names) else {}
    out = []
    for t in sorted({t for by_t in reports.values() for t in by_t}, key=float):
        at_t = {label: by_t[t] for label, by_t in reports.items() if t in by_t}
        kinds = sorted({prompt_category(p["name"], mtbench) for rep in at_t.values() for p in rep["prompts"]})
        for kind in kinds:
            part = {label: [p for p in rep["prompts"] if prompt_category(p["name"], mtbench) == kind]
                    for label, rep in at_t.items()}
            entry = {"temperature": t, "category": kind, "labels": {}}
            for label, prompts in part.items():
                if not prompts:
                    continue
                cell = {"prompts": len(prompts), "tau": tau_interval(prompts)["tau"]}
                if label != reference and part.get(reference):
                    try:
                        cell["vs_reference"] = paired_difference(prompts, part[reference])
                    except PromptMismatch as e:
                        cell["vs_reference"] = {"not_paired": str(e)}
                entry["labels"][label] = cell
            out.append(entry)
    return out


def render_by_category(entries: list[dict], reference: str) -> str:
    """Markdown: one line per (temperature, category), each label's tau, and each other label's
    paired difference from the reference."""
    labels = list(dict.fromkeys(label for e in entries for label in e["labels"]))
    others = [x for x in labels if x != reference]
    head = ["T", "prompts", "category"] + [f"τ {x}" for x in labels] + [f"{x} − {reference} (paired)" for x in others]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for e in entries:
        cells = e["labels"]
        n = max(c["prompts"] for c in cells.values())
        lines.append("| " + " | ".join(
            [e["temperature"], str(n), e["category"]]
            + [f"{cells[x]['tau']:.3f}" if x in cells else "–" for x in labels]
            + [format_difference(cells.get(x, {}).get("vs_reference")) for x in others]) + " |")
    return "\n".join(lines) + "\n"


def render_diff_in_diff(entries: list[dict]) -> str:
    lines = ["| T | (τ A1 − τ A0) − (τ B1 − τ B0) | value (95 % interval) |", "| --- | --- | --- |"]
    for e in entries:
        a1, a0, b1, b0 = e["labels"]
        lines.append(f"| {e['temperature']} | ({a1} − {a0}) − ({b1} − {b0}) | {format_difference(e)} |")
    return "\n".join(lines) + "\n"


def render(table: dict) -> str:
    """Markdown: one row per label, tau (interval) and the paired difference at each temperature."""
    temps, ref = table["temperatures"], table["reference"]
    head = ["label"]
    for t in temps:
        head += [f"τ T={t} (95 % interval)", f"− {ref} at T={t} (paired)"]
    head += [f"accepted per position (T={temps[0]})", "lossless (T=0)"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for row in table["rows"]:
        cells = [row["label"]]
        for t in temps:
            e = row["evals"].get(t)
            iv = e["interval"] if e else None
            cells += [f"{iv['tau']:.3f} ({iv['low']:.3f} to {iv['high']:.3f})" if iv else "–",
                      "reference" if row["label"] == ref and e else format_difference((e or {}).get("vs_reference"))]
        first, zero = row["evals"].get(temps[0]), row["evals"].get("0")
        cells += [format_positions(first["accept_rate"]) if first else "–", (zero or {}).get("lossless") or "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", metavar="LABEL=PATH", help="an eval report (repeatable per label)")
    p.add_argument("--reference", default=None, help="the label every other is paired against (default: the first)")
    p.add_argument("--out", default=None, help="write the markdown here, and the figures as JSON beside it")
    p.add_argument("--diff-in-diff", action="append", default=[], metavar="A1,A0,B1,B0",
                   help="does A1's change over A0 gain more than B1's over B0: (τ A1 − τ A0) − (τ B1 − τ B0), "
                        "paired on the prompts (repeatable)")
    p.add_argument("--across-seeds", action="append", default=[], metavar="A1+A2,B1+B2",
                   help="draft A (one label per training seed) against draft B: the seeds' means, and the order "
                        "where every pairing of an A seed with a B seed is established (repeatable)")
    p.add_argument("--by-category", action="store_true",
                   help="also each label's tau per kind of prompt (MT-Bench's categories; other prompts by "
                        "source) and its paired difference from the reference there")
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        reports = load_reports(a.reports)
        table = build_table(reports, a.reference or next(iter(reports)))
        table["by_category"] = by_category(reports, table["reference"]) if a.by_category else []
        table["diff_in_diff"] = [e for spec in a.diff_in_diff for e in diff_in_diff(reports, spec)]
        table["across_seeds"] = [e for spec in a.across_seeds for e in compare_across_seeds(reports, spec)]
    except CompareError as e:
        print(f"compare_evals: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    text = render(table)
    if table["diff_in_diff"]:
        text += "\n" + render_diff_in_diff(table["diff_in_diff"])
    if table["across_seeds"]:
        text += "\n" + render_across_seeds(table["across_seeds"])
    if table["by_category"]:
        text += "\n" + render_by_category(table["by_category"], table["reference"])
    write_markdown(a.out, text, table)
    print(text, end="")


if __name__ == "__main__":
    main()
