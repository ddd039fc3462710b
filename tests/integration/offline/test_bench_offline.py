"""scripts/bench_offline.py's cache is one the offline trainer accepts (the same job facts), and its
size and bandwidth report add up."""

from __future__ import annotations

import json
import os

import pytest
import torch

from scripts.bench_offline import job_overrides, parse_args, report, run_write
from titan_draft.features.offline import build_offline_target, load_feature_cache
from titan_draft.features.target import build_target_tokenizer
from titan_draft.config import ConfigManager
from titan_draft.protocols import get_model_spec
from titan_draft.components.model_args import resolve_model_args
from titan_draft.data.chat.format import build_chat_format


def test_bench_cache_passes_the_trainers_checks(tmp_path):
    a = parse_args(["--out", str(tmp_path), "--tiny", "--warmup", "1", "--steps", "2"])
    w = run_write(a)
    assert w["rows"] == a.batch * 3 and w["disk_read"]["bytes"] == w["cache_bytes"]
    # 2 capture layers x 64 x bf16 + id and mask; the headers add a little
    assert 261 <= w["bytes_per_token"] < 261 * 1.1
    cfg = ConfigManager().parse_args(job_overrides(a, "offline"))
    spec = get_model_spec(cfg.model.name)
    target = build_offline_target(cfg, torch.device("cpu"), torch.float32)
    tok = build_target_tokenizer(cfg, target.args.vocab_size)
    chat = build_chat_format(cfg.data, tok)
    args = resolve_model_args(spec, cfg, target.args, tok, chat)
    manifest = load_feature_cache(cfg, target, tok, chat, layer_ids=spec.capture_layers_fn(args),
                                  need_last_hidden=spec.needs_last_hidden, reserved_ids=spec.reserved_tokens_fn(args),
                                  dp_rank=0, dp_world=1)
    assert manifest["rows"] == w["rows"]
    with open(os.path.join(a.out, "write.json"), "w") as f:
        json.dump(w, f)
    assert "disk read bandwidth" in report(a)


def test_prepare_case_reports_its_cost_against_the_online_target(tmp_path):
    import re

    from scripts.bench_offline import run_prepare

    a = parse_args(["--out", str(tmp_path), "--tiny", "--warmup", "1", "--steps", "2", "--prepare-rows", "8",
                    "--writers", "3"])
    p = run_prepare(a)
    assert p["rows"] == 8 and p["computed_tokens"] >= p["tokens"] > 0 and p["forward_seconds"] > 0
    assert p["batches"] == -(-8 // a.batch)
    with open(os.path.join(a.out, "prepare.json"), "w") as f:
        json.dump(p, f)
    steps = {"online": 30.0, "synthetic": 20.0}
    for case, ms in steps.items():
        with open(os.path.join(a.out, f"{case}.json"), "w") as f:
            json.dump({"step_ms": ms, "data_wait_ms": 0.0, "data_wait_pct": 0.0, "tokens_per_step": 1000}, f)
    text = report(a)
    cost_us = (30.0 - 20.0) / 1000 * 1e3  # the online target's µs per computed token
    ratio = float(re.search(r"online target cost per token: ([0-9.]+)", text).group(1))
    per_token = 1e6 * p["forward_median_seconds"] * p["batches"] / p["computed_tokens"]
    assert ratio == pytest.approx(per_token / cost_us, abs=0.006)
    # the disk's own write rate beside the shards' (the fsynced test file is gone again)
    w = p["disk_write"]
    assert w["bytes"] == 64 << 20 and w["gb_per_s"] == pytest.approx(w["bytes"] / w["seconds"] / 1e9)
    assert re.search(r"by 3 writers, the disk's own sequential write \(fsynced 64 MiB writes\) [0-9.]+ GB/s", text)
    assert os.listdir(a.out) and not any(n.endswith(".tmp") or n == "prepare_cache" for n in os.listdir(a.out))
