"""How much of the target's next-token probability a draft vocabulary leaves out, along decodes.

    python scripts/vocab_mass.py --target outputs/targets/smollm2 --draft outputs/eagle3_smollm2/export[,OTHER] \
        --temperatures 0,1 [--prompts mtbench --num-prompts 0 --max-new-tokens 256 --out mass.json]

An EAGLE-3 export drafts from its own vocabulary (``draft_vocab_size`` tokens; ``t2d`` marks them
among the target's), so the target's probability of every other token is acceptance it cannot
earn: greedily a round ends wherever the target's argmax lies outside; with speculative sampling
the first drafted token is accepted with probability ``sum_v min(p_v, q_v) <= 1 - p(outside)``.
The vocabulary was chosen by the training tokens' frequencies, mostly greedy answers, which say
little of the tail a temperature of 1 draws from. This decodes each eval prompt plainly at each
temperature (rendered as ``titan_draft.eval`` renders them, in the draft's chat format; T > 0
samples with seed ``--seed`` + i for prompt i) and reports over the decoded positions the
target's probability outside the vocabulary at that temperature (at T = 0: 1 where the argmax is
outside, else 0). Several exports are read on the same decodes (the decodes are the target's).
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
from titan_draft.checkpoint.export import load_export, read_provenance  # noqa: E402
from titan_draft.data.chat.prompts import stop_token_ids  # noqa: E402
from titan_draft.data.tokenizer import build_tokenizer  # noqa: E402
from titan_draft.decoding.eval_target import load_checked_target, resolve_target_backend  # noqa: E402
from titan_draft.decoding.sampling import plain_decode, tempered_probs  # noqa: E402
from titan_draft.eval import build_run_prompts, resolve_device  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python scripts/vocab_mass.py", description=__doc__.split("\n\n")[0])
    add_read_args(p, draft_help="export folders whose model.safetensors holds t2d, comma-separated: each read "
                                "on the same decodes")
    p.add_argument("--temperatures", default="0,1", help="comma-separated decoding temperatures")
    p.add_argument("--out", default=None, help="JSON: the figures, and each decode's tokens and masses per draft")
    a = p.parse_args(argv)
    a.temperatures = parse_temperatures(a.temperatures, "--temperatures", "vocab_mass")
    if a.max_new_tokens < 1:
        raise SystemExit("vocab_mass: error: --max-new-tokens must be >= 1")
    return a


def read_vocabulary(folder: str) -> tuple[torch.Tensor, dict]:
    """``(in_vocab [V] bool, the export's run info)``; refused in one line where the export has no
    draft vocabulary."""
    try:
        tensors, _ = load_export(folder)
    except FileNotFoundError as e:
        raise SystemExit(f"vocab_mass: error: {e}") from None
    if "t2d" not in tensors:
        raise SystemExit(f"vocab_mass: error: {folder}: no t2d tensor (its draft proposes from the target's "
                         "whole vocabulary, nothing is left out)")
    try:
        return tensors["t2d"].bool(), read_provenance(folder).get("run", {})
    except ValueError as e:
        raise SystemExit(f"vocab_mass: error: {e}") from None


@torch.no_grad()
def next_token_logits(target, prompt: list[int], tokens: list[int], device: torch.device) -> torch.Tensor:
    """The target's logits ``[len(tokens), V]`` before each of ``tokens``, in one forward."""
    ids = torch.tensor([prompt + tokens], device=device)
    return target(ids)[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)]


def outside_mass(logits: torch.Tensor, in_vocab: torch.Tensor, temperature: float) -> list[float]:
    """The probability outside ``in_vocab`` at each row of ``logits`` at ``temperature``; at T = 0,
    whether the row's argmax is outside."""
    if temperature <= 0:
        return (~in_vocab[logits.argmax(dim=-1)]).double().tolist()
    return (1.0 - tempered_probs(logits, temperature)[:, in_vocab].sum(dim=-1)).double().tolist()


def summarize(masses: list[float]) -> dict:
    ordered = sorted(masses)
    return {"positions": len(masses), "mean": statistics.fmean(masses), "median": statistics.median(masses),
            "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(sys.argv[1:] if argv is None else argv)
    device = resolve_device(a.device)
    drafts = a.draft.split(",")
    read = [read_vocabulary(d) for d in drafts]
    try:
        target, _ = load_checked_target(a.target, drafts, dtype=getattr(torch, a.dtype), device=device,
                                        backend=resolve_target_backend(a.target_backend, [r for _, r in read]),
                                        allow_mismatch=a.allow_target_mismatch)
    except ValueError as e:
        raise SystemExit(f"vocab_mass: error: {e}") from None
    for d, (in_vocab, _) in zip(drafts, read):
        if in_vocab.numel() != target.args.vocab_size:
            raise SystemExit(f"vocab_mass: error: {d}: t2d covers {in_vocab.numel()} tokens, the target has "
                             f"{target.args.vocab_size}")
    vocabs = [in_vocab.to(device) for in_vocab, _ in read]
    run = read[0][1]  # the prompts are rendered in the drafts' chat format, which must be one
    keys = ("chat_template", "system_prompt", "enable_thinking")
    for d, (_, other) in zip(drafts[1:], read[1:]):
        if any(other.get(k) != run.get(k) for k in keys):
            raise SystemExit(f"vocab_mass: error: {d} was trained in another chat format than {drafts[0]} "
                             f"({', '.join(f'{k} {other.get(k)!r}' for k in keys)}): read them on separate decodes")
    tokenizer = build_tokenizer(a.target)
    try:
        chat, prompts = build_run_prompts(run, tokenizer, a.prompts, a.num_prompts, key="the draft's chat_template")
    except ValueError as e:
        raise SystemExit(f"vocab_mass: error: {e}") from None
    stop = stop_token_ids(tokenizer, chat.template)
    result = {"target": a.target, "drafts": {d: {"draft_vocab_size": int(v.sum()), "temperatures": {}}
                                             for d, v in zip(drafts, vocabs)}, "decodes": {}}
    for t in a.temperatures:
        decodes, masses = [], [[] for _ in drafts]
        for i, prompt in enumerate(prompts):  # one decode per prompt, read against every vocabulary
            gen = plain_decode(target, prompt.ids, a.max_new_tokens, stop, device, temperature=t, seed=a.seed + i)
            logits = next_token_logits(target, prompt.ids, gen.tokens, device)
            outside = [outside_mass(logits, v, t) for v in vocabs]
            decodes.append({"name": prompt.name, "prompt_ids": prompt.ids, "tokens": gen.tokens, "outside": outside})
            for m, o in zip(masses, outside):
                m += o
        result["decodes"][f"{t:g}"] = decodes
        for d, m in zip(drafts, masses):
            figures = result["drafts"][d]["temperatures"][f"{t:g}"] = summarize(m)
            print(f"T={t:g}, {d}: the target's probability outside its {result['drafts'][d]['draft_vocab_size']}-token "
                  f"vocabulary over {figures['positions']} decoded positions of {len(prompts)} prompts: mean "
                  f"{figures['mean']:.4f}, median {figures['median']:.4f}, 90th percentile {figures['p90']:.4f}",
                  flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
