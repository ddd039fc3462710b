"""Decode speed of a target, eager against CUDA graphs, in one run.

    python scripts/bench_decode.py --target outputs/targets/smollm2 [--batch 1024] [--context 600]

Three cases, each timed eagerly and through ``GraphedDecoder`` on the same cache contents:
a greedy step at batch 1 (T = 1), a verify pass of a 16-token block at batch 1 (T = 16), and a
regeneration step at batch ``--batch`` over ``--context`` left-padded cached tokens; then, for
each draft of ``--proposals`` (DFlash2, EAGLE-3, DSpark; random weights, ``--draft-flavor``) after
``--context`` committed tokens, its proposal (up to its tokens read on the host) and its share of
a round (the proposal and the commit of one token), eager and with the proposal as a CUDA graph.
Medians of ``--iters`` calls after ``--warmup``, with the ratio eager / graphs. ``--target
smollm2-shape`` runs on random weights of SmolLM2's shape (no files).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dataclasses import replace  # noqa: E402

from titan_draft.distributed.cuda_graphs import GraphedDecoder  # noqa: E402
from titan_draft.features.target import load_target  # noqa: E402


def _median_ms(fn, cache, start: int, warmup: int, iters: int) -> float:
    times = []
    for i in range(warmup + iters):
        cache.crop(start)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def bench_case(target, batch: int, context: int, new: int, warmup: int, iters: int, logits: str) -> tuple[float, float]:
    """``(eager ms, graphs ms)`` of one cached forward of ``new`` tokens after ``context``."""
    dev = next(target.parameters()).device
    vocab = target.args.vocab_size
    ctx = torch.randint(0, vocab, (batch, context), device=dev)
    step = torch.randint(0, vocab, (batch, new), device=dev)
    pad = torch.zeros(batch, dtype=torch.long, device=dev) if batch > 1 else None
    out = []
    for graphed in (False, True):
        runner = GraphedDecoder(target) if graphed else target
        cache = runner.new_cache(batch, context + new, pad=pad) if graphed else \
            target.new_cache(batch, context + new, pad=pad)
        runner(ctx, cache=cache, logits="none", need_last_hidden=False)
        fn = functools.partial(runner, step, cache=cache, logits=logits, need_last_hidden=False)
        out.append(_median_ms(fn, cache, context, warmup, iters))
        del runner, cache, fn
    return out[0], out[1]


def _smollm2_shape(dtype):
    from models.targets.qwen3 import Qwen3Model, qwen3_flavors

    args = replace(qwen3_flavors["debugmodel"], hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152, qk_norm=False)
    with torch.device("cuda"):
        m = Qwen3Model(args)
    m.init_weights(seed=0)
    return m.to(dtype).eval().requires_grad_(False)


PROPOSALS = ("dflash2", "eagle3", "dspark")


def _build_proposal(kind: str, flavor: str, target, device="cuda"):
    """``(draft, proposer class, extra kwargs)``: a ``kind`` draft of ``flavor`` with random weights
    over ``target`` (its capture rule, its vocabulary, its frozen tables)."""
    t = target.args
    n = t.num_hidden_layers
    if kind == "eagle3":
        from models.eagle3 import Eagle3Draft, Eagle3Proposer, eagle3_capture_layers, eagle3_flavors

        a = eagle3_flavors[flavor]
        a = replace(a, vocab_size=t.vocab_size, target_layer_ids=eagle3_capture_layers(n), num_target_layers=n,
                    target_hidden_size=t.hidden_size, draft_vocab_size=min(a.draft_vocab_size, t.vocab_size))
        model_cls, proposer_cls = Eagle3Draft, Eagle3Proposer
    else:
        if kind == "dspark":
            from models.dspark import DSparkDraft as model_cls, DSparkProposer as proposer_cls, dspark_flavors as fl
        else:
            from models.dflash2 import DFlash2Draft as model_cls, dflash2_flavors as fl
            from models.dflash2.proposal import DFlashProposer as proposer_cls
        a = replace(fl[flavor], vocab_size=t.vocab_size, target_layer_ids=[1, n // 2, n - 2], num_target_layers=n,
                    mask_token_id=t.vocab_size - 1)
    with torch.device(device):
        draft = model_cls(a)
    draft.init_weights()
    draft = draft.to(next(target.parameters()).dtype).eval()
    draft.load_frozen_tables(target.embed_weight(), target.lm_head_weight())
    return draft, proposer_cls


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def bench_proposer(target, kind: str, flavor: str, context: int, warmup: int, iters: int, device="cuda",
                   modes=(False, True), **options) -> dict[bool, tuple[float, float]]:
    """``{graphs: (proposal ms, draft round ms)}`` of ``kind`` after ``context`` committed tokens,
    eager (False) and with the proposal as a CUDA graph (True). The proposal is timed up to its
    tokens read on the host (the eval reads them); the round adds the commit of the round's
    token (nothing accepted: one token a round), the draft's whole share of a round. ``options``:
    the proposer's (``graph_commit=True``: the commit replayed too, where graphs are on)."""
    draft, proposer_cls = _build_proposal(kind, flavor, target, device)
    layers = list(draft.args.target_layer_ids)
    ids = torch.randint(0, target.args.vocab_size - 1, (1, context + warmup + iters + 1), device=device)
    aux = target.capture(ids, layers, False)[0][0]
    out = {}
    for graphs in modes:
        p = proposer_cls(draft, graphs=graphs, **options)
        p.reset(ids.shape[1] + 64)
        p.commit(ids[0, :context], aux[:context])
        proposal, rounds = [], []
        for i in range(warmup + iters):
            pos = context + i
            _sync(device)
            t0 = time.perf_counter()
            p.propose(int(ids[0, pos])).tolist()
            t1 = time.perf_counter()
            p.commit(ids[0, pos : pos + 1], aux[pos : pos + 1])
            _sync(device)
            if i >= warmup:
                proposal.append((t1 - t0) * 1e3)
                rounds.append((time.perf_counter() - t0) * 1e3)
        out[graphs] = (statistics.median(proposal), statistics.median(rounds))
        del p
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=1024, help="rows of the regeneration case")
    p.add_argument("--context", type=int, default=600, help="cached tokens before the timed call")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--draft-flavor", default="smollm2", help="flavor of the proposal cases ('': skip them)")
    p.add_argument("--proposals", default=",".join(PROPOSALS),
                   help=f"comma-separated drafts whose proposals are timed, of {list(PROPOSALS)}")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode: needs a CUDA device (CUDA graphs)")
    dtype = getattr(torch, a.dtype)
    target = _smollm2_shape(dtype) if a.target == "smollm2-shape" else load_target(a.target, dtype=dtype, device="cuda")
    cases = [("greedy step, batch 1", 1, 1, "last"), ("verify 16 tokens, batch 1", 1, 16, "all"),
             (f"regeneration step, batch {a.batch}", a.batch, 1, "last")]
    print(f"| case ({a.dtype}, {a.context} cached tokens) | eager ms | graphs ms | eager / graphs | graphs tokens/s |")
    print("| --- | --- | --- | --- | --- |")
    for name, batch, new, logits in cases:
        eager, graphs = bench_case(target, batch, a.context, new, a.warmup, a.iters, logits)
        tokens = batch * (new if logits == "last" and batch > 1 else 1)
        print(f"| {name} | {eager:.2f} | {graphs:.2f} | {eager / graphs:.2f}x | {tokens / graphs * 1e3:.0f} |", flush=True)
    kinds = [k for k in a.proposals.split(",") if k] if a.draft_flavor else []
    bad = [k for k in kinds if k not in PROPOSALS]
    if bad:
        raise SystemExit(f"bench_decode: --proposals: {bad} not among {list(PROPOSALS)}")
    for kind in kinds:
        # the block drafts' plain row commits eagerly (graph_commit is their default where graphs are on)
        plain = {} if kind == "eagle3" else {"graph_commit": False}
        t = bench_proposer(target, kind, a.draft_flavor, a.context, a.warmup, a.iters, **plain)
        rows = [("proposal", t[False][0], t[True][0]),
                ("draft round (proposal + commit of 1 token)", t[False][1], t[True][1])]
        if kind != "eagle3":  # the block drafts' fixed-width commit (graph_commit)
            f = bench_proposer(target, kind, a.draft_flavor, a.context, a.warmup, a.iters, graph_commit=True)
            rows.append(("draft round, graph_commit", f[False][1], f[True][1]))
        for what, eager, graphs in rows:
            print(f"| {kind} `{a.draft_flavor}` {what}, batch 1 | {eager:.2f} | {graphs:.2f} | "
                  f"{eager / graphs:.2f}x | - |", flush=True)


if __name__ == "__main__":
    main()
