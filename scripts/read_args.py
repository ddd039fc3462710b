"""The arguments of the scripts that read a draft against its target along the target's own
decodes (``first_token.py``, ``vocab_mass.py``): which target, draft and prompts, in what dtype and
on what device, declared once so that the scripts take them alike."""

from __future__ import annotations

import argparse

from titan_draft.decoding.eval_target import add_target_backend_arg


def add_read_args(p: argparse.ArgumentParser, *, draft_help: str) -> None:
    """``--target --target-backend --draft --prompts --num-prompts --max-new-tokens --seed --dtype
    --device --allow-target-mismatch``."""
    p.add_argument("--target", required=True, help="the target's HF folder")
    add_target_backend_arg(p)
    p.add_argument("--draft", required=True, help=draft_help)
    p.add_argument("--prompts", default="mtbench", help="eval prompts, as titan_draft.eval reads them")
    p.add_argument("--num-prompts", type=int, default=0, help="per prompt source (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="prompt i's sampled decode uses seed + i (T > 0)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--device", default="auto")
    p.add_argument("--allow-target-mismatch", action="store_true",
                   help="read the draft(s) even next to a target other than the one recorded in the export")


def parse_temperatures(text: str, flag: str, prog: str) -> list[float]:
    """``"0,1"`` -> ``[0.0, 1.0]``; one line naming ``flag`` for anything else or a negative value."""
    try:
        values = [float(t) for t in text.split(",")]
    except ValueError:
        raise SystemExit(f"{prog}: error: {flag} {text!r}: expected numbers, e.g. 0,1") from None
    if any(t < 0 for t in values):
        raise SystemExit(f"{prog}: error: {flag} must be >= 0")
    return values
