"""results.md of the benchmark: one table from every case JSON under an output folder.

Split runs merge: each case JSON stands alone, the newest run of a case wins, and the table is
rebuilt from whatever is there. A case run with extra job overrides (``benchmark.py ... -- --key
value``, e.g. an ablation in its own output folder) is another case: its row shows them. See docs/performance.md for the columns.
"""

from __future__ import annotations

import json
import os

SCHEMA = "titan_draft.benchmark/1"
"""Marks a case JSON (other JSON files under the output folder are ignored)."""

# SpecForge main (a6b6b023) on our H200, 2026-11-29 (issue 4): plain DFlash, batch 2 x 2048,
# variable masks, optimizer every step, torch 2.11. Its peak is in GB as reported there.
ANCHOR = {"step_ms": 395.0, "samples_per_s": 5.06, "peak_gb": 37.7, "tflop_per_step": 139.5,
          "note": "H200, torch 2.11, 2026-11-29"}
# The same SpecForge on the same H200, its DSpark step at the Qwen3-8B shape (issue 12: 5 layers,
# blocks of 7, 512 anchors, batch 2 x 2048).
DSPARK_ANCHOR = {"step_ms": 311.0, "samples_per_s": 6.43, "peak_gb": 32.0, "tflop_per_step": 73.0,
                 "note": "H200, as quoted in issue 12"}
# Its EAGLE-3 step (FSDP1, fp32-master AdamW, flex; TTT 7, 32k draft vocabulary, batch 2 x 2048).
EAGLE3_ANCHOR = {"step_ms": 203.0, "samples_per_s": 9.85, "peak_gb": 22.1, "tflop_per_step": 67.7,
                 "note": "H200, as quoted in issue 11"}
ANCHORS = {"dflash": ANCHOR, "eagle3": EAGLE3_ANCHOR, "dspark": DSPARK_ANCHOR}


def anchor_of(draft: str) -> tuple[str, dict]:
    """The SpecForge figure a draft's rows are compared with: its own algorithm's (DFlash2 rows
    with DFlash's)."""
    name = next((n for n in ("eagle3", "dspark") if draft.startswith(n)), "dflash")
    return name, ANCHORS[name]
H200_PEAK_TFLOPS = 989.0  # dense bf16 spec (titan_draft.components.metrics.get_peak_flops)

# table order: the variants as each adds to the one before, the anchor's data mode first
VARIANT_ORDER = ("eager", "static", "compile", "float8", "float8_ac", "packed")
MODE_ORDER = ("varmask", "fixed", "varlen")


def _rank(order: tuple[str, ...], value: str) -> int:
    return order.index(value) if value in order else len(order)


def _extra(r: dict) -> tuple[str, ...]:
    return tuple(r.get("extra_overrides") or ())


def _eager_key(r: dict) -> tuple:
    """What a row shares with the eager row it is compared with: all but the variant."""
    c = r["case"]
    return (c["tiny"], c["draft"], c["mode"], c["accum"], c["target"], _extra(r))


def load_results(out: str) -> list[dict]:
    """Case results under ``out`` (subfolders too); of the runs of one case (name and extra
    overrides) the newest wins."""
    latest: dict[tuple, dict] = {}
    for folder, _, files in os.walk(out):
        for name in files:
            if not name.endswith(".json"):
                continue
            try:
                with open(os.path.join(folder, name)) as f:
                    r = json.load(f)
            except (OSError, ValueError):
                continue
            if not isinstance(r, dict) or r.get("schema") != SCHEMA:
                continue
            ident = (r["name"], _extra(r))
            if ident not in latest or r.get("date", "") >= latest[ident].get("date", ""):
                latest[ident] = r

    def key(r):
        c = r["case"]
        return (c["tiny"], c["draft"], _rank(MODE_ORDER, c["mode"]), c["accum"], c["target"], _extra(r),
                _rank(VARIANT_ORDER, c["variant"]))

    return sorted(latest.values(), key=key)


def _fmt(value, spec: str = ".1f") -> str:
    if value is None:
        return "–"
    if spec == ".1f" and 0 < abs(value) < 1:
        return format(value, ".3g")  # the tiny flavor's figures
    return format(value, spec)


_COLUMNS = ("draft", "data", "accum", "target", "variant", "step ms", "samples/s", "× anchor", "× eager",
            "real tokens/s", "pad %", "TFLOP/step", "TFLOP/s", "MFU %", "peak alloc GiB", "peak reserved GiB",
            "data wait ms (%)", "warm-up s", "recompiles", "status")


def _row(r: dict, eager: dict | None) -> list[str]:
    c = r["case"]
    draft = f"{c['draft']} (tiny)" if c["tiny"] else c["draft"]
    variant = " ".join([c["variant"], *_extra(r)])
    head = [draft, os.path.basename(c["mode"]), str(c["accum"]), c["target"], variant]
    if r["status"] != "ok":
        return head + ["–"] * (len(_COLUMNS) - len(head) - 1) + [r["status"]]
    speedup = r["samples_per_s"] / eager["samples_per_s"] if eager else None  # 1.00 on the eager row
    # the anchor is a one-GPU figure at the production shape: compare per GPU, never for --tiny
    vs_anchor = None if c["tiny"] else r["samples_per_s_per_gpu"] / anchor_of(c["draft"])[1]["samples_per_s"]
    notes = ["ok"] + (["profiled"] if r.get("profiled") else [])
    if r.get("world_size", 1) > 1:
        notes.append(f"{r['world_size']} ranks")
    return head + [
        _fmt(r["step_ms_median"]), _fmt(r["samples_per_s"], ".2f"), _fmt(vs_anchor, ".2f"),
        _fmt(speedup, ".2f"),
        _fmt(r["tokens_per_s"], ",.0f"), _fmt(r.get("padding_pct"), ".1f"), _fmt(r["model_tflop_per_step"]), _fmt(r["achieved_tflops"]),
        _fmt(r["mfu_pct"]), _fmt(r["peak_allocated_gib"]), _fmt(r["peak_reserved_gib"]),
        f"{r['data_wait_ms_mean']:.1f} ({r['data_wait_pct']:.1f}%)", _fmt(r["compile_warmup_s"]),
        str(r["recompiles_after_warmup"]), ", ".join(notes),
    ]


def _error_line(log_tail: str) -> str:
    """The last line of a log that names an error (else its last line)."""
    lines = [line.strip() for line in log_tail.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "Error" in line or "error:" in line:
            return line
    return lines[-1] if lines else ""


def render_report(results: list[dict]) -> str:
    lines = ["# titan_draft benchmark", "",
             "Median step over the steady window (after warm-up, device synchronized around each step); "
             "× anchor = samples/s per GPU over SpecForge's for the same algorithm (DFlash 5.06, EAGLE-3 "
             "9.85, DSpark 6.43); × eager = over the eager row of the same draft, data, accumulation, target and extra "
             "overrides (shown after the variant). "
             "Columns: docs/performance.md.", "",
             "| " + " | ".join(_COLUMNS) + " |", "|" + " --- |" * len(_COLUMNS)]
    used = {anchor_of(r["case"]["draft"])[0] for r in results}
    shown = ["dflash"] + [n for n in ("eagle3", "dspark") if n in used]
    for name, a in ((n, ANCHORS[n]) for n in shown):
        anchor_row = [f"SpecForge {name} (anchor)", "varmask", "1", "synthetic", "FSDP1 eager", f"{a['step_ms']:.0f}",
                      f"{a['samples_per_s']:.2f}", "1.00", "–", f"{a['samples_per_s'] * 2048:,.0f}", "–",
                      f"{a['tflop_per_step']:.1f}", f"{a['tflop_per_step'] / a['step_ms'] * 1e3:.0f}",
                      f"{100 * a['tflop_per_step'] / a['step_ms'] * 1e3 / H200_PEAK_TFLOPS:.1f}",
                      f"{a['peak_gb']} (GB)", "–", "–", "–", "–", a["note"]]
        lines.append("| " + " | ".join(anchor_row) + " |")
    eager = {}
    for r in results:
        if r["case"]["variant"] == "eager" and r["status"] == "ok":
            eager[_eager_key(r)] = r
    for r in results:
        lines.append("| " + " | ".join(_row(r, eager.get(_eager_key(r)))) + " |")
    lines += ["", "Runs:", ""]
    runs = sorted({(r.get("date", "?")[:10], r.get("device_name", "?"), r.get("torch", "?"),
                    r.get("world_size", 1), r.get("command", "?")) for r in results if r["status"] == "ok"})
    for date, device, torch_version, world, command in runs:
        lines.append(f"- {date}, {device} x {world}, torch {torch_version}: `{command}`")
    failed = [r for r in results if r["status"] != "ok"]
    for r in failed:
        lines.append(f"- {r['name']}: {r['status']}: {_error_line(r.get('error_tail') or '')[:300]}")
    return "\n".join(lines) + "\n"


def write_report(out: str) -> str:
    path = os.path.join(out, "results.md")
    text = render_report(load_results(out))
    with open(path, "w") as f:
        f.write(text)
    return path

