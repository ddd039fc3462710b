"""Capture a job's target features once, for offline training (``data.feature_cache``).

Takes the training job itself (its TOML and ``--section.key value`` overrides): the same target,
sharded with FSDP2 as training shards it, the same data pipeline (tokenizer, chat template, loss
mask, max_length, reserved-token filter) and the capture layers the job's draft reads.

    python scripts/prepare_features.py --out outputs/features/eagle3_debug \\
        --job.config_file train_configs/eagle3_debug.toml
    torchrun --nproc_per_node 8 scripts/prepare_features.py --out /nvme/features/run1 \\
        --job.config_file train_configs/dflash2_smollm2.toml
    ./run_train.sh --job.config_file train_configs/dflash2_smollm2.toml --data.feature_cache /nvme/features/run1

Each rank renders its rows (``r, r + W, ...`` of the source, in source order), runs the target in
batches of ``training.local_batch_size`` and writes ``shard-r<rank>-<k>.safetensors`` files of
about ``--shard-mb`` (titan_draft/data/features/shards.py) from ``--writers`` background threads,
while the next batches' features come off the device (titan_draft/data/features/capture.py). An
interrupted run started again with the same arguments continues after the last finished shard.
When every rank is done, rank 0 writes ``manifest.json`` (what the features were captured from,
every shard's size and sha256); training refuses a cache without it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titan_draft.features.target import build_target, build_target_tokenizer, check_target_config  # noqa: E402
from titan_draft.config import ConfigManager, validate_job_config  # noqa: E402
from titan_draft.data.chat.format import build_chat_format  # noqa: E402
from titan_draft.data.features.capture import FeatureCopier  # noqa: E402
from titan_draft.data.features.manifest import MANIFEST, job_facts, read_rank_index, write_json_atomic  # noqa: E402
from titan_draft.data.features.shards import FORMAT, STORAGE_DTYPES, row_features, stored_dtype, to_storage  # noqa: E402
from titan_draft.data.features.writer import ShardWriter, resume_rank  # noqa: E402
from titan_draft.data.pipeline import collate_chat, epoch_samples  # noqa: E402
from titan_draft.distributed.parallelize import to_dtype  # noqa: E402
from titan_draft.distributed.utils import ParallelDims, destroy_distributed, init_distributed  # noqa: E402
from titan_draft.logger import init_logger, logger  # noqa: E402
from titan_draft.protocols import get_model_spec  # noqa: E402
from titan_draft.components.model_args import resolve_model_args  # noqa: E402


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=True)
    p.add_argument("--out", required=True, help="cache folder (data.feature_cache of the training job)")
    p.add_argument("--storage", default="bfloat16", choices=STORAGE_DTYPES,
                   help="dtype of the stored features (float8_e4m3: per-token scale, half of bfloat16's bytes)")
    p.add_argument("--shard-mb", type=float, default=1024.0,
                   help="features per shard file in MiB (each DP rank of training reads whole shards)")
    p.add_argument("--writers", type=int, default=4,
                   help="shards written at once (each in flight holds one shard in memory); on H200 machines' "
                        "disks two fell behind the target, four kept up (docs/performance.md, offline mode)")
    p.add_argument("--estimate", action="store_true",
                   help="only render the rows and print the cache's size (no target forward, nothing written)")
    p.add_argument("--last-hidden", action="store_true",
                   help="also store the final-norm last hidden state when the job's draft does not need it")
    return p.parse_known_args(argv)


def _check_resume(folder: str, meta: dict, world: int) -> None:
    """An interrupted run continues only with the same job facts, storage and world size."""
    import json

    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        return
    with open(path) as f:
        old = json.load(f)
    for key in ("storage", "prepare_world"):
        if old.get(key) != meta[key]:
            raise ValueError(f"--out: {path} was started with {key} {old.get(key)!r}, this run has {meta[key]!r}")
    for key, value in meta["facts"].items():
        if old["facts"].get(key) != value:
            raise ValueError(f"--out: {path} was started with another {key} ({old['facts'].get(key)!r}, "
                             f"now {value!r}); use a new folder")
    if old.get("complete"):
        raise ValueError(f"--out: {path} is already complete")


def _any_rank(flag: bool, world: int, device: torch.device) -> bool:
    if world == 1:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def bytes_per_token(num_layers: int, hidden_size: int, storage: str) -> float:
    """Disk bytes of one cached token: the hidden tensors (and float8's per-token scales), its id
    (int32) and its loss-mask byte."""
    width = stored_dtype(storage).itemsize
    scale = 4 if storage == "float8_e4m3" else 0
    return num_layers * (hidden_size * width + scale) + 4 + 1


def _estimate(cfg, tokenizer, chat, reserved, layer_ids, need_last, storage, hidden_size, rank, world, device) -> dict:
    rows = tokens = 0
    for ids, _ in epoch_samples(cfg.data, tokenizer, chat=chat, dp_rank=rank, dp_world=world, seed=cfg.training.seed,
                                reserved_ids=frozenset(reserved)):
        rows += 1
        tokens += len(ids)
    if world > 1:
        t = torch.tensor([rows, tokens], device=device)
        dist.all_reduce(t)
        rows, tokens = t.tolist()
    per_token = bytes_per_token(len(layer_ids) + int(need_last), hidden_size, storage)
    est = {"rows": rows, "tokens": tokens, "bytes_per_token": per_token, "bytes": per_token * tokens}
    logger.info(f"prepare --estimate: {rows} usable rows, {tokens} tokens x {per_token:.0f} bytes/token "
                f"({len(layer_ids)} capture layers{' + last hidden' if need_last else ''} x {hidden_size}, {storage}) "
                f"= {est['bytes'] / 2**30:.2f} GiB")
    return est


@dataclass
class CaptureCounts:
    rows: int
    tokens: int  # the rows' own tokens
    computed: int  # tokens the target computed, padding included
    forward_times: list[float]  # seconds per forward, in order


def capture(cfg, target, tokenizer, samples, writer: ShardWriter, *, layer_ids: list[int], need_last: bool,
            first_row: int, rank: int, world: int, device: torch.device) -> CaptureCounts:
    """Run the target over ``samples`` in batches of ``training.local_batch_size`` and hand each
    row's features to ``writer``, in the writer's storage form (made on the device, so float8 is
    quantized before the copy to the host); rows get cache-wide ids ``(first_row + i) * world + rank``."""
    bsz, t = cfg.training.local_batch_size, cfg.training
    pad_multiple = 16 if cfg.float8.enable else 1
    copier = FeatureCopier(device)  # batch i's copy to the host overlaps batch i+1's forward
    counts = CaptureCounts(0, 0, 0, [])

    def write_rows(done) -> None:
        for i, (ids, mask) in enumerate(done.rows):
            n = len(ids)
            writer.add(ids, mask, (first_row + counts.rows) * world + rank, row_features(done.tensors, i, n, layer_ids))
            counts.rows += 1
            counts.tokens += n

    def next_batch():
        batch = [s for _, s in zip(range(bsz), samples)]
        rows = batch or [([tokenizer.pad_id], [False])]  # a rank out of rows computes a throwaway batch
        return batch, collate_chat(rows, pad_id=tokenizer.pad_id, max_length=cfg.data.max_length,
                                   static_shapes=t.static_shapes, pad_multiple=pad_multiple)

    # The next batch is read and collated while the device still runs this one; under torchrun the
    # check below then waits for this forward only (FSDP: every rank runs every forward).
    batch, b = next_batch()
    while _any_rank(bool(batch), world, device):
        counts.computed += b["input_ids"].numel()
        with copier.forward():
            aux, last = target.model.capture(b["input_ids"].to(device, non_blocking=True), layer_ids, need_last)
            stored = to_storage(aux, last, len(layer_ids), writer.storage)
        if (done := copier.push(batch, stored)) is not None:
            write_rows(done)
        batch, b = next_batch()
    if (done := copier.flush()) is not None:
        write_rows(done)
    counts.forward_times = copier.forward_times()
    return counts


def prepare(argv: list[str]) -> dict:
    """Run the capture; returns the manifest (rank 0) or this rank's summary."""
    a, job_argv = parse_args(argv)
    if a.writers < 1:
        raise ValueError(f"--writers: must be >= 1, got {a.writers}")
    cfg = ConfigManager().parse_args(job_argv)
    validate_job_config(cfg, logger)
    check_target_config(cfg)
    if cfg.data.feature_cache:
        raise ValueError("data.feature_cache: prepare_features captures from the target; leave it empty here")
    info = init_distributed(cfg)
    device, rank, world = info.device, info.rank, info.world_size
    mesh = ParallelDims(dp_shard=-1, world_size=world).build_mesh(device.type)
    target_dtype = cfg.target.dtype if device.type == "cuda" else "float32"  # as training runs it
    spec = get_model_spec(cfg.model.name)
    target = build_target(cfg, device, to_dtype(target_dtype), mesh=mesh)
    tokenizer = build_target_tokenizer(cfg, target.args.vocab_size)
    chat = build_chat_format(cfg.data, tokenizer)
    model_args = resolve_model_args(spec, cfg, target.args, tokenizer, chat)
    layer_ids = sorted(set(spec.capture_layers_fn(model_args)))
    need_last = spec.needs_last_hidden_for(model_args) or a.last_hidden
    reserved = list(spec.reserved_tokens_fn(model_args)) if spec.reserved_tokens_fn is not None else []
    facts = job_facts(cfg, target.args, tokenizer, chat, layer_ids, need_last, reserved)
    if a.estimate:
        return _estimate(cfg, tokenizer, chat, reserved, layer_ids, need_last, a.storage, target.args.hidden_size, rank,
                         world, device)
    meta = {"format": FORMAT, "complete": False, "storage": a.storage, "prepare_world": world,
            "target_dtype": target_dtype, "draft": cfg.model.name, "facts": facts}
    os.makedirs(a.out, exist_ok=True)
    if rank == 0:
        _check_resume(a.out, meta, world)
        write_json_atomic(os.path.join(a.out, MANIFEST), meta)
    if world > 1:
        dist.barrier()

    done = resume_rank(a.out, rank)
    skip = sum(e["rows"] for e in done)
    writer = ShardWriter(a.out, rank, storage=a.storage, shard_bytes=int(a.shard_mb * 2**20), first_shard=len(done),
                         writers=a.writers)
    logger.info(f"prepare: rank {rank}/{world}, capture layers {layer_ids}, last_hidden {need_last}, storage "
                f"{a.storage}, {len(done)} shards ({skip} rows) already done")
    samples = epoch_samples(cfg.data, tokenizer, chat=chat, dp_rank=rank, dp_world=world, seed=cfg.training.seed,
                            reserved_ids=frozenset(reserved))
    for _ in range(skip):
        next(samples, None)
    start = time.perf_counter()
    counts = capture(cfg, target, tokenizer, samples, writer, layer_ids=layer_ids, need_last=need_last,
                     first_row=skip, rank=rank, world=world, device=device)
    times = counts.forward_times
    fwd_s = sum(times)
    written = writer.close()
    elapsed = time.perf_counter() - start
    logger.info(f"prepare: rank {rank} wrote {len(written)} shards, {counts.rows} rows, {counts.tokens} tokens in "
                f"{elapsed:.1f}s (target forward {fwd_s:.1f}s on the device: {counts.tokens / max(fwd_s, 1e-9):.0f} "
                f"tokens/s, {counts.computed} tokens computed with the padding)")
    if world > 1:
        dist.barrier()
    result = {"rank": rank, "rows": counts.rows, "tokens": counts.tokens, "computed_tokens": counts.computed,
              "seconds": elapsed, "forward_seconds": fwd_s, "batches": len(times),
              "forward_median_seconds": statistics.median(times) if times else 0.0}
    if rank == 0:
        shards = [e for r in range(world) for e in read_rank_index(a.out, r)]
        meta.update(complete=True, rows=sum(s["rows"] for s in shards), tokens=sum(s["tokens"] for s in shards),
                    bytes=sum(s["bytes"] for s in shards), rank0_timing=result, shards=shards)
        write_json_atomic(os.path.join(a.out, MANIFEST), meta)
        logger.info(f"prepare: {a.out} complete: {meta['rows']} rows, {meta['tokens']} tokens, "
                    f"{meta['bytes'] / 2**30:.2f} GiB in {len(shards)} shards")
        result = meta
    return result


def main(argv: list[str] | None = None) -> None:
    init_logger()
    try:
        prepare(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"prepare_features: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        destroy_distributed()


if __name__ == "__main__":
    main()
