"""ShareGPT's rows cut after the first answer to their first user turn, as gzipped JSONL: what the
recipe's regeneration passes read (they answer the first user turn), small enough (~11 MB) to
carry to a GPU machine that cannot install the 100+ MB sharegpt wheel.
    python scripts/dev/cut_first_turns.py --out .big/d/sharegpt_first_turns.jsonl.gz
A row keeps the turns before its first user turn (a system turn, or answers left over from a
split conversation, which the normalizer skips), so that every row the full source can use asks the
same first query. A few more become usable (40 of 17671 ShareGPT rows): their defect, an empty
turn or two turns of one role, lay after the first answer.

Cutting at the first answer of the whole row instead (a row may open with an answer) made 6370
rows unusable, and one lease's regeneration answered 9489 prompts instead of 14682.
"""

from __future__ import annotations

import argparse
import gzip
import json

from titan_draft.data.source_files import iter_source
from titan_draft.data.sources import normalize_row

USER, ASSISTANT = {"human", "user"}, {"gpt", "assistant", "chatgpt", "bard", "bing", "model"}


def cut(conversations: list) -> list:
    roles = [t.get("from", t.get("role")) if isinstance(t, dict) else None for t in conversations]
    first_user = next((i for i, r in enumerate(roles) if r in USER), None)
    if first_user is None:
        return conversations
    answer = next((i for i in range(first_user + 1, len(roles)) if roles[i] in ASSISTANT), len(roles) - 1)
    return conversations[: answer + 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="sharegpt")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    kept = same = 0
    with gzip.open(a.out, "wt", encoding="utf-8") as f:
        for row in iter_source(a.source):
            if not isinstance(row, dict) or not isinstance(row.get("conversations"), list):
                continue
            short = {**row, "conversations": cut(row["conversations"])}
            full = normalize_row(row, prompt_only=True)
            same += isinstance(full, str) or normalize_row(short, prompt_only=True) == full
            f.write(json.dumps(short, ensure_ascii=False) + "\n")
            kept += 1
    print(f"wrote {kept} rows to {a.out} ({kept - same} whose first query differs from the full row's)")


if __name__ == "__main__":
    main()
