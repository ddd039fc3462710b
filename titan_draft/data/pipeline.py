"""The dataloader: a job's data source -> padded micro-batches, one pipeline per DP rank.

``build_dataloader`` asks the registry (sources/registry.py) which source the job names and lets
it build the loader. Sources of token rows (conversations, synthetic rows) share the pipeline
built here:

    source node (conversations: shard, shuffle, render, truncate, skip+count; or synthetic rows)
      -> [PackingNode: whole conversations into rows of max_length (data.packing)]
      -> Batcher(local_batch_size) -> Mapper(collate) -> [Prefetcher] -> Loader

The Prefetcher snapshots the source node's state with every batch it reads ahead, so the
Loader's state describes what the training loop consumed, not what the background thread read.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from typing import Any, Optional

import torch
import torchdata.nodes as tn

from titan_draft.data.chat.format import build_chat_format
from titan_draft.data.loader_state import RankStateLoader
from titan_draft.data.packing import PackingNode, collate_packed
from titan_draft.data.reshard import reshard_position
from titan_draft.data.sources.chat import STATE_KEY, ChatSourceNode, Sample
from titan_draft.data.sources.registry import LoaderContext, get_data_source, loader_source
from titan_draft.data.sources.render_pool import default_render_workers
from titan_draft.data.sources.rows import split_rows
from titan_draft.data.tokenizer import Tokenizer
from titan_draft.data.worker_errors import ForwardErrorsNode

__all__ = ["ChatDataLoader", "build_chat_loader", "build_dataloader", "build_rows_loader", "chat_samples",
           "collate_chat", "epoch_samples"]

logger = logging.getLogger(__name__)


def collate_chat(
    samples: list[Sample], *, pad_id: int, max_length: int, static_shapes: bool, pad_multiple: int
) -> dict[str, torch.Tensor]:
    """Pad samples into ``input_ids [B,S]``, ``loss_mask [B,S]`` and ``valid_lengths [B]``.

    ``S`` is ``max_length`` with static shapes (one shape per run for compiled blocks), else the
    longest sample rounded up to ``pad_multiple``. Padding is ``pad_id`` with mask False.
    """
    lengths = [len(ids) for ids, _ in samples]
    if static_shapes:
        seq_len = max_length
    else:
        seq_len = -(-max(lengths) // pad_multiple) * pad_multiple
    input_ids = torch.full((len(samples), seq_len), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((len(samples), seq_len), dtype=torch.bool)
    for i, (ids, mask) in enumerate(samples):
        input_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        loss_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.bool)
    return {
        "input_ids": input_ids,
        "loss_mask": loss_mask,
        "valid_lengths": torch.tensor(lengths, dtype=torch.long),
    }


class ChatDataLoader(RankStateLoader):
    """Infinite, resumable iterator of padded batches for one DP rank (``RankStateLoader``), over a
    row source: conversations (``ChatSourceNode``) or synthetic rows. On a DP change it continues
    the saved run's position where that is exact (data/reshard.py) and refuses otherwise.

    Args:
        loader: the Loader over the pipeline whose first node is ``source``.
        source: the pipeline's source node.
        dp_rank, dp_world: this rank's index and the DP size.
    """

    def __init__(self, loader: tn.Loader, source: ChatSourceNode, *, dp_rank: int, dp_world: int,
                 worker: Optional[ForwardErrorsNode] = None, packed: bool = False):
        super().__init__(loader, source_key=STATE_KEY, dp_rank=dp_rank, dp_world=dp_world,
                         rows_per_rank=len(source.rows), worker=worker)
        self._source = source
        self._packed = packed

    def _resharded(self, saved: list[dict[str, Any]]) -> dict[str, Any]:
        if self._packed:  # which waiting conversations a rank held is not something a new rank can take over
            return super()._resharded(saved)
        sources = self._saved_sources(saved)
        epoch, position = reshard_position(
            sources, new_rank=self.dp_rank, new_world=self.dp_world, num_rows=len(self._source.rows),
            order=self._source.epoch_order, shuffled=self._source.shuffle)
        # Which of a saved rank's skipped rows fall to which new rank is not recorded: the counts
        # restart (the rows themselves are exact).
        logger.info("data: DP rank %d of %d continues the position saved by %d DP ranks exactly: epoch %d, %d of "
                    "its %d rows read (skip counts restart at zero)", self.dp_rank, self.dp_world, len(sources),
                    epoch, position, len(self._source.rows))
        return self._with_source(saved[0], {"epoch": epoch, "position": position, "skip_counts": {},
                                            "epoch_skip_counts": {}, "epoch_usable": 0,
                                            "num_rows": len(self._source.rows)})


def build_dataloader(
    data_cfg: Any,
    tokenizer: Tokenizer,
    *,
    chat: Any = None,
    dp_rank: int,
    dp_world: int,
    local_batch_size: int,
    seed: int,
    static_shapes: bool,
    pad_multiple: int = 1,
    reserved_ids: frozenset[int] = frozenset(),
    warn_below_rows: int = 0,
    layer_ids: tuple[int, ...] = (),
    need_last_hidden: bool = False,
    pin_memory: bool = False,
) -> RankStateLoader:
    """Build this DP rank's dataloader from the ``[data]`` config section: the source the job
    names (``sources.registry.loader_source``) builds it.

    Args:
        data_cfg: ``JobConfig.data``.
        tokenizer: the target's tokenizer (``build_tokenizer``).
        chat: the run's resolved ``ChatFormat`` (None: resolved here from ``data_cfg``, for a
            caller that builds one loader; a run resolves it once and hands it to every part).
        dp_rank, dp_world: this rank's index and the number of DP ranks (rows are split by them).
        local_batch_size: samples per batch (``training.local_batch_size``).
        seed: shuffle seed (``training.seed``).
        static_shapes: pad every batch to ``data.max_length`` (``training.static_shapes``).
        pad_multiple: without static shapes, round the batch length up to this multiple.
        reserved_ids: token ids the draft reserves; conversation rows holding one are skipped.
        warn_below_rows: warn when this rank has (or an epoch yields) fewer usable rows than this
            (the trainer passes 10 optimizer steps' worth).
        layer_ids, need_last_hidden, pin_memory: what a source whose batches carry the target's
            features (a feature cache) reads and how it hands them over.

    Raises:
        ValueError: naming the config key, for a missing or empty source or an invalid size.
    """
    if data_cfg.max_length <= 0:
        raise ValueError(f"data.max_length: must be > 0, got {data_cfg.max_length}")
    if data_cfg.prefetch_factor < 0:
        raise ValueError(f"data.prefetch_factor: must be >= 0, got {data_cfg.prefetch_factor}")
    if local_batch_size <= 0:
        raise ValueError(f"training.local_batch_size: must be > 0, got {local_batch_size}")
    if pad_multiple <= 0:
        raise ValueError(f"pad_multiple must be > 0, got {pad_multiple}")
    ctx = LoaderContext(data=data_cfg, tokenizer=tokenizer, chat=chat or build_chat_format(data_cfg, tokenizer),
                        dp_rank=dp_rank, dp_world=dp_world, local_batch_size=local_batch_size, seed=seed, static_shapes=static_shapes,
                        pad_multiple=pad_multiple, reserved_ids=frozenset(reserved_ids),
                        warn_below_rows=warn_below_rows, layer_ids=tuple(layer_ids),
                        need_last_hidden=need_last_hidden, pin_memory=pin_memory)
    return loader_source(data_cfg).build_loader(ctx)


def epoch_samples(data_cfg: Any, tokenizer: Tokenizer, *, chat: Any = None, dp_rank: int, dp_world: int, seed: int,
                  reserved_ids: frozenset[int] = frozenset(), render_workers: int | None = None):
    """This DP rank's usable samples of ``data.source`` once, rendered and truncated as training
    renders them (what a draft's data pass, e.g. EAGLE-3's vocabulary count, and prepare_features
    read). Offline too: ``data.source`` names the conversations behind a feature cache. ``chat``
    as in ``build_dataloader``; ``render_workers``: forked processes that render a conversation
    source (the same samples in the same order; None: ``default_render_workers()``, up to 8;
    ``sources/render_pool.py``)."""
    source = get_data_source(data_cfg.source)
    if source.samples is None:
        raise ValueError(f"data.source: {data_cfg.source!r} ({source.name}) gives no token rows to read once")
    ctx = LoaderContext(data=data_cfg, tokenizer=tokenizer, chat=chat or build_chat_format(data_cfg, tokenizer),
                        dp_rank=dp_rank, dp_world=dp_world, seed=seed, reserved_ids=frozenset(reserved_ids),
                        render_workers=default_render_workers() if render_workers is None else render_workers)
    yield from source.samples(ctx)


def build_rows_loader(source: tn.BaseNode, ctx: LoaderContext) -> ChatDataLoader:
    """The shared pipeline after a source node of token rows (module docstring); with
    ``data.packing`` the rows are packed conversations (data/packing.py)."""
    node: tn.BaseNode = source
    if ctx.data.packing:
        node = PackingNode(node, max_length=ctx.data.max_length, window=ctx.data.packing_window)
        collate = partial(collate_packed, pad_id=ctx.tokenizer.pad_id, max_length=ctx.data.max_length)
    else:
        collate = partial(
            collate_chat,
            pad_id=ctx.tokenizer.pad_id,
            max_length=ctx.data.max_length,
            static_shapes=ctx.static_shapes,
            pad_multiple=ctx.pad_multiple,
        )
    node = tn.Batcher(node, batch_size=ctx.local_batch_size, drop_last=True)
    node = tn.Mapper(node, collate)
    worker = None
    if ctx.data.prefetch_factor > 0:
        worker = node = ForwardErrorsNode(node)  # whatever the thread raises reaches the loop
        # snapshot_frequency=1: a snapshot per batch, so a resume never replays or loses one.
        node = tn.Prefetcher(node, prefetch_factor=ctx.data.prefetch_factor, snapshot_frequency=1)
    return ChatDataLoader(tn.Loader(node), source, dp_rank=ctx.dp_rank, dp_world=ctx.dp_world, worker=worker,
                          packed=ctx.data.packing)


def build_chat_loader(ctx: LoaderContext) -> ChatDataLoader:
    """The loader of a conversation source (one whose ``DataSource.rows`` reads ``data.source``)."""
    return build_rows_loader(_chat_source(ctx), ctx)


def chat_samples(ctx: LoaderContext):
    """A conversation source's usable samples once, in source order."""
    yield from _chat_source(replace(ctx, static_shapes=False, warn_below_rows=0)).usable_samples(ctx.render_workers)


def _chat_source(ctx: LoaderContext) -> ChatSourceNode:
    """This DP rank's conversations of ``data.source``, rendered with the run's chat format."""
    data_cfg, dp_rank, dp_world = ctx.data, ctx.dp_rank, ctx.dp_world
    split = split_rows(
        data_cfg.source, max_rows=data_cfg.max_rows, dp_rank=dp_rank, dp_world=dp_world,
        skip_rows=data_cfg.holdout_rows,
    )
    rows, total = split.rows, split.total
    if not rows:
        raise ValueError(
            f"data.source: {total} rows (data.max_rows={data_cfg.max_rows}) leave DP rank "
            f"{dp_rank} of {dp_world} with none"
        )
    held_out = ""
    if data_cfg.holdout_rows:
        held_out = (f" after {data_cfg.holdout_rows} held-out rows and {split.held_out_repeats} that repeat "
                    "their prompts")
    logger.info(
        "data: %s, %d rows%s, %d on DP rank %d/%d, template %s, max_length %d, %s shapes",
        data_cfg.source, total, held_out, len(rows), dp_rank, dp_world, ctx.chat.describe(),
        data_cfg.max_length, "static" if ctx.static_shapes else "dynamic",
    )  # fmt: skip
    if len(rows) < ctx.warn_below_rows:
        logger.warning("data: only %d rows on DP rank %d (at most that many usable), fewer than 10 optimizer "
                       "steps' worth (%d): every row will be repeated many times", len(rows), dp_rank,
                       ctx.warn_below_rows)
    return ChatSourceNode(
        rows,
        ctx.tokenizer,
        chat=ctx.chat,
        max_length=data_cfg.max_length,
        seed=ctx.seed,
        shuffle=data_cfg.shuffle,
        reserved_ids=ctx.reserved_ids,
        warn_below_rows=ctx.warn_below_rows,
        describe_row=lambda i: f"row {split.positions[i]} (0-based) of data.source {data_cfg.source}",
    )
