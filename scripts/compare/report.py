"""The comparison table of scripts/compare_drafts.py, built from the files its stages wrote.

Each row is read from one draft's folder: its training record (``train.json``: steps, wall clock,
median step, memory peaks) and its eval reports (``eval_t<T>_<dtype>.json``, written by
``python -m titan_draft.eval --out``). Nothing is carried in memory from the runs, so a table
rebuilt after an interruption is the table of the files on disk.
"""

from __future__ import annotations

import json
import os

from titan_draft.decoding.tau_interval import PromptMismatch, across_seeds, paired_difference, tau_interval

SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}
POSITIONS_SHOWN = 8


def eval_report_name(temperature: float, dtype: str) -> str:
    return f"eval_t{temperature:g}_{dtype}.json"


def _load(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def speed_source(temperatures: list[float], speed_dtype: str | None) -> tuple[float, str] | None:
    """The (temperature, dtype) report whose plain and speculative tokens/s the table shows: greedy
    in ``speed_dtype`` when asked, else the fp32 greedy one (None without T = 0)."""
    if speed_dtype is not None:
        return 0.0, speed_dtype
    return (0.0, "float32") if 0.0 in temperatures else None


def build_row(folder: str, label: str, info: dict, temperatures: list[float], speed_dtype: str | None) -> dict:
    """One draft's row from its folder: ``info`` says what it is (draft, config, overrides, budget);
    missing files leave their cells None."""
    train = _load(os.path.join(folder, "train.json")) or {}
    plan = _load(os.path.join(folder, "plan.json")) or {}
    cal = plan.get("calibration", {})
    row = {"label": label, **info,
           "plan": {"predicted_job_min": plan["predicted_job_s"] / 60, "calibration_median_step_ms":
                    1e3 * cal["median_step_s"], "setup_s": cal["setup_s"], "save_s": cal["save_s"]} if plan else None,
           "training_min": train["wall_s"] / 60 if "wall_s" in train else None,
           "steps": train.get("steps"), "median_step_ms": train.get("median_step_ms"),
           "peaks_gib": train.get("peaks_gib"), "attempts": train.get("attempts"), "evals": {},
           # what the job spent besides its steps (start-up, target load, compile, saves, export):
           # at a budget of a few minutes it decides how many steps a draft gets
           "setup_s": (train["wall_s"] - train["steps"] * train["median_step_ms"] / 1e3
                       if {"wall_s", "steps", "median_step_ms"} <= train.keys() else None)}
    for t in temperatures:
        report = _load(os.path.join(folder, eval_report_name(t, "float32")))
        if report is None:
            continue
        s = report["summary"]
        row["evals"][f"{t:g}"] = {
            "tau": s["tau"], "accept_rate": s["accept_rate"], "num_prompts": s["num_prompts"],
            "lossless_prompts": s["lossless_prompts"], "num_draft_tokens": s["num_draft_tokens"],
            "proposed_per_round": s["proposed_per_round"], "rounds": s["rounds"], "new_tokens": s["new_tokens"],
            # a report written before drafts sampled at T > 0 has no key: its drafts were point masses
            "draft_sampling": s.get("draft_sampling", "greedy" if t <= 0 else "point mass"),
            # per prompt, for the intervals: which prompts moved tau, and whether two drafts saw the same ones
            "tau_interval": tau_interval(report["prompts"]) if report["prompts"] else None,
            "per_prompt": [{k: p[k] for k in ("name", "round_tokens", "rounds")} for p in report["prompts"]]}
    source = speed_source(temperatures, speed_dtype)
    row["speed"] = None
    if source is not None:
        report = _load(os.path.join(folder, eval_report_name(*source)))
        if report is not None:
            s = report["summary"]
            row["speed"] = {"dtype": source[1], "speculative_tokens_per_s": s["speculative_tokens_per_s"],
                            "plain_tokens_per_s": s["greedy_tokens_per_s"], "ratio": s["speedup"]}
    return row


def _overrun(row: dict) -> str:
    """``label (T of B min; median step X ms, the calibration's Y)``."""
    text = f"{row['label']} ({row['training_min']:.2f} of {row['budget_min']:g} min"
    cal = (row.get("plan") or {}).get("calibration_median_step_ms")
    if cal and row.get("median_step_ms"):
        text += f"; median step {row['median_step_ms']:.1f} ms, the calibration's {cal:.1f}"
    return text + ")"


def _num(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _peak(peaks: dict | None) -> str:
    if not peaks:
        return "–"
    if "max_allocated_gib" in peaks:
        return f"{peaks['max_allocated_gib']:.1f} / {peaks.get('max_reserved_gib', float('nan')):.1f}"
    return f"{peaks['peak_rss_gib']:.1f} (RSS)" if "peak_rss_gib" in peaks else "–"


def format_positions(rates: list[float]) -> str:
    shown = rates[:POSITIONS_SHOWN]
    return " / ".join(f"{r:.2f}" for r in shown) + (" / …" if len(rates) > POSITIONS_SHOWN else "")


def comparisons(rows: list[dict], meta: dict) -> tuple[list[dict], list[dict]]:
    """(single runs paired, drafts across their training seeds): the first for a comparison of one
    run a draft, the second where ``meta`` names its training seeds (``--training-seeds``)."""
    if meta.get("training_seeds"):
        return [], seed_comparisons(rows, meta["view"])
    return paired_comparisons(rows, meta["view"]), []


def render_markdown(rows: list[dict], meta: dict, compared: tuple[list[dict], list[dict]] | None = None) -> str:
    """The table as markdown, headed by what was compared and how; ``compared``: the
    :func:`comparisons` of ``rows`` where the caller has them."""
    temps = [f"{t:g}" for t in meta["temperatures"]]
    first = "0" if "0" in temps else temps[0]
    speed = speed_source(meta["temperatures"], meta.get("speed_dtype"))
    sp = SHORT_DTYPE.get(speed[1], speed[1]) if speed else "–"
    head = (["draft", "budget min", "training min", "setup s", "steps", "median step ms", "peak GiB"]
            + [f"τ T={t}" for t in temps] + [f"accepted per position (T={first})", f"lossless (T={first}, fp32)",
                                              f"speculative tok/s ({sp})", f"plain tok/s ({sp})", "ratio"])
    lines = [f"# Draft comparison: {meta['view']}", "",
             (f"Each draft trained for the same wall-clock budget ({meta['minutes']:g} min a job, start to exit, "
              f"setup and compile included), steps chosen from a {meta['calibration_steps']}-step calibration job; "
              f"then decoded on {meta['prompts']} ({meta['max_new_tokens']} new tokens) in fp32 at "
              f"T = {', '.join(temps)} (sampling seed {meta['seed']}). Date {meta['date']}."
              + (f" Each draft trained once per training seed ({', '.join(map(str, meta['training_seeds']))}), "
                 "every seed the same steps." if meta.get("training_seeds") else "")), "",
             f"Command: `{meta.get('command', '')}`", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    # tau at T > 0 is the papers' figure only when the drafts were drawn from their own q
    unsampled = [f"{r['label']} (T={t}: {e['draft_sampling']})" for r in rows for t, e in r["evals"].items()
                 if float(t) > 0 and e.get("draft_sampling", "point mass") != "q"]
    if unsampled:
        lines[-2:-2] = [(f"Drafts not drawn from their own distribution q at T > 0 (verified as point masses, a lower "
                        f"acceptance than speculative sampling's): {', '.join(unsampled)}."), ""]
    for r in rows:
        evals = r["evals"]
        cells = [r["label"], _num(r["budget_min"], ".2f"), _num(r["training_min"], ".2f"),
                 _num(r.get("setup_s"), ".0f"), _num(r["steps"], "d"),
                 _num(r["median_step_ms"], ".1f"), _peak(r["peaks_gib"])]
        cells += [_num(evals[t]["tau"], ".3f") if t in evals else "–" for t in temps]
        e = evals.get(first)
        cells.append(format_positions(e["accept_rate"]) if e else "–")
        cells.append(f"{e['lossless_prompts']}/{e['num_prompts']}" if e and e["lossless_prompts"] is not None else "–")
        s = r["speed"] or {}
        cells += [_num(s.get("speculative_tokens_per_s"), ".1f"), _num(s.get("plain_tokens_per_s"), ".1f"),
                  _num(s.get("ratio"), ".2f") + ("×" if s.get("ratio") is not None else "")]
        lines.append("| " + " | ".join(cells) + " |")
    over = [r for r in rows if r["training_min"] is not None and r["training_min"] > r["budget_min"]]
    if over:
        lines += ["", "Over the budget: " + ", ".join(_overrun(r) for r in over) + ". A step slower than the "
                  "calibration's is another process on the GPU (comparisons run one at a time: docs/compare.md) or "
                  "a slower machine; such a row had more time than the others."]
    resumed = [f"{r['label']} ({r['attempts']})" for r in rows if (r.get("attempts") or 1) > 1]
    if resumed:
        lines += ["", f"Trained in several attempts (training min sums them): {', '.join(resumed)}."]
    pairs, across = comparisons(rows, meta) if compared is None else compared
    lines += render_intervals(rows, meta, pairs)
    if across:
        lines += ["", "## Across training seeds", "",
                  ("Each draft's seeds against another's: the mean τ of its seeds and their range, the difference of "
                   "the means with its prompt interval, and how many pairings of an A seed with a B seed the prompts "
                   "establish. A second training run can move τ by more than the prompts' interval holds, so the order "
                   "is established only where every pairing is, on the same side."), "",
                  render_across_seeds(across).rstrip("\n")]
    return "\n".join(lines) + "\n"


def _baseline(rows: list[dict], row: dict) -> dict | None:
    """An ablation row's recipe as it is: the row of the same config without the view's overrides."""
    return next((r for r in rows if r.get("config") == row.get("config") and not r.get("view_overrides")), None)


def _comparisons(rows: list[dict], view: str, unit_of, compare, name) -> list[dict]:
    """Which units of rows to compare at each temperature, and how: in the ablation view each
    changed setting against its recipe as it is, otherwise each unit against every unit below it
    in (mean) tau. ``unit_of(row)`` names a row's unit, ``compare(a, b)`` takes each unit's rows'
    per-prompt evals, ``name(rows)`` is what the entry calls a unit."""
    units: dict[str, list[dict]] = {}
    for r in rows:
        units.setdefault(unit_of(r), []).append(r)
    out = []
    for t in sorted({t for r in rows for t in r["evals"]}, key=float):
        have = {u: rs for u, rs in units.items() if all((r["evals"].get(t) or {}).get("per_prompt") for r in rs)}
        if view == "ablation":
            pairs = [(u, unit_of(b)) for u, rs in have.items()
                     if (b := _baseline(rows, rs[0])) is not None and unit_of(b) in have and unit_of(b) != u]
        else:
            mean = {u: sum(r["evals"][t]["tau"] for r in rs) / len(rs) for u, rs in have.items()}
            ranked = sorted(have, key=lambda u: -mean[u])
            pairs = [(x, y) for i, x in enumerate(ranked) for y in ranked[i + 1:]]
        for ua, ub in pairs:
            entry = {"temperature": t, "a": name(have[ua]), "b": name(have[ub])}
            try:
                entry.update(compare(*([r["evals"][t]["per_prompt"] for r in have[u]] for u in (ua, ub))))
            except PromptMismatch as e:
                entry["not_paired"] = str(e)
            out.append(entry)
    return out


def paired_comparisons(rows: list[dict], view: str) -> list[dict]:
    """Which differences in tau the prompts establish, at each temperature (see :func:`_comparisons`
    for which pairs). Paired: both drafts' tau on the same resampled prompts."""
    return _comparisons(rows, view, lambda r: r["label"], lambda a, b: paired_difference(a[0], b[0]),
                        lambda rs: rs[0]["label"])


def _group(row: dict) -> str:
    return row.get("group") or row["label"]


def seed_comparisons(rows: list[dict], view: str) -> list[dict]:
    """The drafts trained with several seeds (rows sharing a ``group``), compared as
    :func:`paired_comparisons` compares single runs (each against those below it in mean tau), but
    with the order called only where every pairing of the two drafts' seeds is established on the
    prompts: the prompt bootstrap does not see how far a second training run moves tau."""
    return _comparisons(rows, view, _group, across_seeds, lambda rs: [r["label"] for r in rs])


def write_markdown(path: str | None, text: str, figures: dict) -> None:
    """The markdown at ``path`` and the figures as JSON beside it (``table.md`` -> ``table.json``);
    nothing without a path."""
    if not path:
        return
    with open(path, "w") as f:
        f.write(text)
    with open(os.path.splitext(path)[0] + ".json", "w") as f:
        json.dump(figures, f, indent=2)


def format_difference(d: dict | None) -> str:
    """'+0.012 (-0.003 to +0.027)', ', established' where the interval excludes 0."""
    if d is None:
        return "–"
    if "not_paired" in d:
        return f"not paired: {d['not_paired']}"
    return (f"{d['difference']:+.3f} ({d['low']:+.3f} to {d['high']:+.3f})"
            + (", established" if d["established"] else ""))


def render_across_seeds(entries: list[dict]) -> str:
    """Markdown: one line per :func:`seed_comparisons` entry (or compare_evals' --across-seeds)."""
    lines = ["| T | A (seeds) | B (seeds) | τ A, mean (range) | τ B, mean (range) | mean A − mean B (95 %, prompts) "
             "| pairings established |", "|" + " --- |" * 7]
    for e in entries:
        head = f"| {e['temperature']} | {' + '.join(e['a'])} | {' + '.join(e['b'])} |"
        if "not_paired" in e:
            lines.append(f"{head} – | – | not paired: {e['not_paired']} | – |")
            continue
        verdict = f"{e['established_pairings']} of {len(e['pairings'])}"
        verdict += ", order established" if e["established"] else ""
        lines.append(f"{head} {e['tau_a']:.3f} ({e['spread_a']:.3f}) | {e['tau_b']:.3f} ({e['spread_b']:.3f}) | "
                     f"{format_difference(e['mean'])} | {verdict} |")
    return "\n".join(lines) + "\n"


def render_intervals(rows: list[dict], meta: dict, pairs: list[dict]) -> list[str]:
    """Markdown: each tau's interval over prompts, and the paired differences."""
    cells = [(t, r) for t in (f"{x:g}" for x in meta["temperatures"]) for r in rows
             if (r["evals"].get(t) or {}).get("tau_interval")]
    if not cells:
        return []
    level = cells[0][1]["evals"][cells[0][0]]["tau_interval"]
    lines = ["", "## How sure the order is", "",
             (f"{100 * level['level']:g} % percentile-bootstrap intervals over the prompts ({level['resamples']} "
              "resamples). A difference is paired: each resample draws one set of prompts and takes both τ on it, "
              "so the prompts' shared difficulty cancels; the order is established when its interval excludes 0."),
             "", "| T | draft | τ | interval |", "| --- | --- | --- | --- |"]
    for t, r in cells:
        iv = r["evals"][t]["tau_interval"]
        lines.append(f"| {t} | {r['label']} | {iv['tau']:.3f} | {iv['low']:.3f} to {iv['high']:.3f} |")
    if pairs:
        lines += ["", "| T | difference | τ a − τ b | interval | a ahead in | order |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for p in pairs:
            name = f"{p['a']} − {p['b']}"
            if "not_paired" in p:
                lines.append(f"| {p['temperature']} | {name} | – | – | – | not paired: {p['not_paired']} |")
                continue
            lines.append(f"| {p['temperature']} | {name} | {p['difference']:+.3f} | {p['low']:+.3f} to "
                         f"{p['high']:+.3f} | {100 * p['a_ahead']:.0f} % | "
                         f"{'established' if p['established'] else 'not established'} |")
    return lines


def write_table(out_dir: str, rows: list[dict], meta: dict) -> tuple[str, str]:
    """``<out>/table_<view>.md`` and ``.json``; returns their paths."""
    base = os.path.join(out_dir, f"table_{meta['view']}")
    pairs, across = comparisons(rows, meta)
    with open(base + ".md", "w") as f:
        f.write(render_markdown(rows, meta, (pairs, across)))
    with open(base + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows, "paired": pairs, "across_seeds": across}, f, indent=2)
    return base + ".md", base + ".json"
