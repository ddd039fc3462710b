#!/usr/bin/env python3
"""Record the token lengths of a chat source, for the benchmark's real-length synthetic modes.

Renders rows of a chat source with a tokenizer and chat template, as training renders them, and
writes their lengths: ``(tokens, loss tokens)`` of each usable row, untruncated, in source order.
The benchmark's ``synthetic:first_exchange`` and ``synthetic:conversation`` rows draw their lengths
from the two files recorded with this script (titan_draft/data/sources/lengths/), so that a
benchmark shows what padding costs on real data without the data itself:

    python scripts/length_histogram.py --cut first_exchange --rows 3000 \\
        --out titan_draft/data/sources/lengths/first_exchange.json
    python scripts/length_histogram.py --cut conversation --rows 3000 \\
        --out titan_draft/data/sources/lengths/conversation.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from titan_draft.data.chat.format import resolve_chat_format  # noqa: E402
from titan_draft.data.chat.template import render_chat  # noqa: E402
from titan_draft.data.sources.registry import source_rows  # noqa: E402
from titan_draft.data.sources.rows import normalize_row  # noqa: E402
from titan_draft.data.tokenizer import build_tokenizer  # noqa: E402

CUTS = ("first_exchange", "conversation")


def record_lengths(rows, tokenizer, chat, cut: str, limit: int) -> list[list[int]]:
    """``[tokens, loss tokens]`` of the first ``limit`` usable rows; ``first_exchange`` keeps a
    row's system turn, first user turn and first answer (what scripts/regenerate_data.py writes)."""
    out = []
    for row in rows:
        turns = normalize_row(row)
        if isinstance(turns, str):
            continue
        if cut == "first_exchange":
            first_user = next((i for i, t in enumerate(turns) if t.role == "user"), None)
            if first_user is None or first_user + 1 >= len(turns):
                continue
            turns = turns[: first_user + 2]
        ids, mask = render_chat(turns, tokenizer, chat.template, chat.system_prompt,
                                enable_thinking=chat.enable_thinking, last_turn_only=chat.last_turn_only)
        if any(mask):
            out.append([len(ids), sum(mask)])
        if len(out) == limit:
            break
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="sharegpt", help="data.source to read (default: the packaged ShareGPT)")
    p.add_argument("--tokenizer", default="qwen3", help="target.tokenizer (default: the packaged Qwen3 BPE)")
    p.add_argument("--template", default="auto", help="data.chat_template")
    p.add_argument("--cut", choices=CUTS, required=True)
    p.add_argument("--rows", type=int, default=3000, help="usable rows to record")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    tokenizer = build_tokenizer(a.tokenizer)
    chat = resolve_chat_format(tokenizer, template=a.template, system_prompt="auto", enable_thinking=True,
                               last_turn_only=False)
    lengths = record_lengths(source_rows(a.source), tokenizer, chat, a.cut, a.rows)
    record = {"source": a.source, "tokenizer": a.tokenizer, "template": chat.template, "cut": a.cut,
              "rows": len(lengths), "lengths": lengths}
    with open(a.out, "w") as f:
        json.dump(record, f, separators=(",", ":"))
        f.write("\n")
    tokens = sorted(n for n, _ in lengths)
    print(f"{a.out}: {len(lengths)} rows, median {tokens[len(tokens) // 2]} tokens, "
          f"p90 {tokens[int(0.9 * len(tokens))]}")


if __name__ == "__main__":
    main()
