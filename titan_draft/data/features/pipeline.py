"""The offline dataloader: feature shards -> padded batches that carry the captured features.

    FeatureShardNode (this rank's shards, shuffled; rows shuffled within each shard)
      -> [PackingNode: cached conversations packed into rows as they are read (data.packing)]
      -> Batcher(local_batch_size) -> Mapper(collate_features) -> [Prefetcher] -> Loader

The same collate and static padding as the online pipeline (``collate_chat``) make the token
tensors; the features are padded beside them with zeros. As in the online pipeline, the node's
small state (epoch, shard position, row position) decides what comes next, the permutations are
recomputed from the seed on resume, and the Prefetcher snapshots the state with every batch.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import Any, Optional

import torch
import torchdata.nodes as tn

from titan_draft.data.features.shards import ShardReader
from titan_draft.data.features.reshard import reshard_feature_position
from titan_draft.data.loader_state import RankStateLoader
from titan_draft.data.packing import PackingNode, collate_packed
from titan_draft.data.pipeline import collate_chat
from titan_draft.data.sources.chat import hashed_seed

__all__ = ["FeatureDataLoader", "FeatureShardNode", "build_feature_dataloader", "collate_features",
           "collate_packed_features", "rank_shards"]

logger = logging.getLogger(__name__)

STATE_KEY = "feature_shards"


def rank_shards(shards: list[dict[str, Any]], dp_rank: int, dp_world: int) -> list[dict[str, Any]]:
    """Shard ``j`` (in file-name order) goes to DP rank ``j % dp_world``: whole files per rank, so
    no two ranks read the same bytes."""
    ordered = sorted(shards, key=lambda s: s["file"])
    return ordered[dp_rank::dp_world]


class FeatureShardNode(tn.BaseNode[dict]):
    """Yields this rank's cached rows (ids, mask, features), epoch after epoch, forever.

    Each epoch visits the shards in a seeded order and each shard's rows in a seeded order of
    their own (the shard is the shuffle buffer); with ``shuffle`` off both are file order.
    Only the shard being read is open, and only the rows asked for are read from it.
    """

    def __init__(self, folder: str, shards: list[dict[str, Any]], *, layer_ids: list[int], need_last_hidden: bool,
                 seed: int, shuffle: bool):
        super().__init__()
        self.folder = folder
        self.shards = shards
        self.layer_ids = list(layer_ids)
        self.need_last_hidden = need_last_hidden
        self.seed = seed
        self.shuffle = shuffle
        self.num_rows = sum(s["rows"] for s in shards)
        self._epoch = 0
        self._shard_pos = 0
        self._row_pos = 0
        self._shard_order: list[int] = []
        self._reader: Optional[ShardReader] = None
        self._reader_key: Optional[tuple[int, int]] = None
        self._row_order: list[int] = []

    def shard_order(self, num_shards: int, epoch: int) -> list[int]:
        """The order a rank of ``num_shards`` shards visits them in ``epoch`` (a function of the count,
        not of the rank, so a DP change can recompute any rank's; data/features/reshard.py)."""
        if not self.shuffle:
            return list(range(num_shards))
        g = torch.Generator().manual_seed(hashed_seed("titan_draft.features.shards", self.seed, epoch))
        return torch.randperm(num_shards, generator=g).tolist()

    def row_order(self, file: str, num_rows: int, epoch: int) -> list[int]:
        """The order shard ``file``'s rows are read in ``epoch``, whichever rank reads it."""
        if not self.shuffle:
            return list(range(num_rows))
        g = torch.Generator().manual_seed(hashed_seed(f"titan_draft.features.rows:{file}", self.seed, epoch))
        return torch.randperm(num_rows, generator=g).tolist()

    def _set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        self._shard_order = self.shard_order(len(self.shards), epoch)

    def reset(self, initial_state: Optional[dict[str, Any]] = None) -> None:
        super().reset(initial_state)
        self._reader, self._reader_key = None, None
        if initial_state is None:
            self._set_epoch(0)
            self._shard_pos = self._row_pos = 0
            return
        state = initial_state[STATE_KEY]
        files = [s["file"] for s in self.shards]
        if state["files"] != files:
            raise ValueError(
                f"data: the dataloader state was saved over feature shards {state['files'][:3]}... "
                f"({len(state['files'])} files) but this DP rank now reads {files[:3]}... ({len(files)}): "
                "data.feature_cache changed?"
            )
        self._set_epoch(state["epoch"])
        self._shard_pos, self._row_pos = state["shard_pos"], state["row_pos"]

    def _current_reader(self) -> ShardReader:
        shard = self._shard_order[self._shard_pos]
        key = (self._epoch, shard)
        if self._reader_key != key:
            entry = self.shards[shard]
            self._reader = ShardReader(os.path.join(self.folder, entry["file"]), self.layer_ids, self.need_last_hidden)
            if len(self._reader) != entry["rows"]:
                raise ValueError(f"data.feature_cache: {self._reader.path} holds {len(self._reader)} rows, "
                                 f"the manifest records {entry['rows']}")
            self._row_order = self.row_order(entry["file"], entry["rows"], self._epoch)
            self._reader_key = key
        return self._reader

    def next(self) -> dict:
        reader = self._current_reader()
        row = reader.row(self._row_order[self._row_pos])
        self._row_pos += 1
        # Roll over now so that the state always names the next row.
        if self._row_pos == self.shards[self._shard_order[self._shard_pos]]["rows"]:
            self._row_pos = 0
            self._shard_pos += 1
            if self._shard_pos == len(self.shards):
                self._set_epoch(self._epoch + 1)
                self._shard_pos = 0
        return row

    def get_state(self) -> dict[str, Any]:
        return {STATE_KEY: {"epoch": self._epoch, "shard_pos": self._shard_pos, "row_pos": self._row_pos,
                            "files": [s["file"] for s in self.shards]}}


def _pad_rows(rows: list[torch.Tensor], seq_len: int) -> torch.Tensor:
    out = torch.zeros((len(rows), seq_len, rows[0].shape[-1]), dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


_FEATURES = (("hidden", "aux_hidden"), ("hidden_scale", "aux_scale"), ("last_hidden", "last_hidden"),
             ("last_hidden_scale", "last_scale"))


def collate_features(samples: list[dict], *, pad_id: int, max_length: int, static_shapes: bool,
                     pad_multiple: int) -> dict[str, torch.Tensor]:
    """``collate_chat``'s ``input_ids``, ``loss_mask``, ``valid_lengths``, plus ``aux_hidden
    [B, S, K*H]`` (and ``last_hidden [B, S, H]``) in the storage dtype, zero past each row's end,
    the float8 scales as ``aux_scale [B, S, K]`` / ``last_scale [B, S, 1]``, and ``row_ids [B]``."""
    batch = collate_chat([(s["input_ids"], s["loss_mask"]) for s in samples], pad_id=pad_id,
                         max_length=max_length, static_shapes=static_shapes, pad_multiple=pad_multiple)
    seq_len = batch["input_ids"].shape[1]
    batch["row_ids"] = torch.tensor([s["row_id"] for s in samples], dtype=torch.long)
    for src, dst in _FEATURES:
        if src in samples[0]:
            batch[dst] = _pad_rows([s[src] for s in samples], seq_len)
    return batch


def collate_packed_features(rows: list[list[dict]], *, pad_id: int, max_length: int) -> dict[str, torch.Tensor]:
    """Packed rows of cached conversations: ``collate_packed``'s tensors, the features of each
    row's documents back to back (zero in the padding tail), and ``row_ids`` of every document in
    row order (``documents`` says how many each row holds)."""
    batch = collate_packed([[(s["input_ids"], s["loss_mask"]) for s in row] for row in rows], pad_id=pad_id,
                           max_length=max_length)
    batch["row_ids"] = torch.tensor([s["row_id"] for row in rows for s in row], dtype=torch.long)
    for src, dst in _FEATURES:
        if src in rows[0][0]:
            batch[dst] = _pad_rows([torch.cat([s[src] for s in row]) for row in rows], max_length)
    return batch


class FeatureDataLoader(RankStateLoader):
    """Infinite, resumable iterator of feature batches for one DP rank (``RankStateLoader``: the
    same state layout as ``ChatDataLoader``). ``rows_per_rank`` is the row count of the DP rank with
    the fewest (every rank computes the same epoch length). On a DP change it continues the saved
    position where no row is lost or read twice (data/features/reshard.py), and refuses otherwise.

    Args:
        source: the pipeline's ``FeatureShardNode``; ``shards``: the manifest's whole shard list.
    """

    def __init__(self, loader: tn.Loader, *, dp_rank: int, dp_world: int, rows_per_rank: int,
                 source: FeatureShardNode, shards: list[dict[str, Any]], packed: bool = False):
        super().__init__(loader, source_key=STATE_KEY, dp_rank=dp_rank, dp_world=dp_world, rows_per_rank=rows_per_rank)
        self._source = source
        self._shards = shards
        self._packed = packed

    def _resharded(self, saved: list[dict[str, Any]]) -> dict[str, Any]:
        if self._packed:  # the conversations a rank held waiting cannot be handed to another rank
            return super()._resharded(saved)
        sources = self._saved_sources(saved)
        files = lambda r, w: [s["file"] for s in rank_shards(self._shards, r, w)]  # noqa: E731
        mine = files(self.dp_rank, self.dp_world)
        epoch, shard_pos, row_pos = reshard_feature_position(
            sources, [files(r, len(sources)) for r in range(len(sources))], mine,
            {s["file"]: s["rows"] for s in self._shards}, new_rank=self.dp_rank, new_world=self.dp_world,
            shard_order=self._source.shard_order, row_order=self._source.row_order, shuffled=self._source.shuffle)
        logger.info("data: DP rank %d of %d continues the feature-cache position saved by %d DP ranks: epoch %d, "
                    "%d of its %d shards done, %d rows into the next", self.dp_rank, self.dp_world, len(sources),
                    epoch, shard_pos, len(mine), row_pos)
        return self._with_source(saved[0], {"epoch": epoch, "shard_pos": shard_pos, "row_pos": row_pos, "files": mine})


def build_feature_dataloader(folder: str, shards: list[dict[str, Any]], *, data_cfg: Any, pad_id: int, dp_rank: int,
                             dp_world: int, local_batch_size: int, seed: int, static_shapes: bool, pad_multiple: int,
                             layer_ids: list[int], need_last_hidden: bool,
                             pin_memory: bool = False) -> FeatureDataLoader:
    """This DP rank's loader over a checked cache (``shards``: the manifest's list). ``pin_memory``
    (training on CUDA): batches are pinned in a background thread, so that the trainer's
    ``non_blocking`` copy of ~0.2 GB of features a step is a real asynchronous DMA."""
    if len(shards) < dp_world:
        raise ValueError(f"data.feature_cache: {folder} has {len(shards)} shards, fewer than the {dp_world} DP "
                         "ranks that each read whole shards (prepare it again with a smaller --shard-mb)")
    mine = rank_shards(shards, dp_rank, dp_world)
    rows_per_rank = min(sum(s["rows"] for s in rank_shards(shards, r, dp_world)) for r in range(dp_world))
    logger.info("data: feature cache %s, %d shards / %d rows on DP rank %d/%d, %s",
                folder, len(mine), sum(s["rows"] for s in mine), dp_rank, dp_world,
                "shuffled" if data_cfg.shuffle else "in file order")
    source = FeatureShardNode(folder, mine, layer_ids=layer_ids, need_last_hidden=need_last_hidden, seed=seed,
                              shuffle=data_cfg.shuffle)
    node: tn.BaseNode = source
    if data_cfg.packing:  # the cache holds one conversation per row; rows are packed as they are read
        node = PackingNode(node, max_length=data_cfg.max_length, window=data_cfg.packing_window,
                           length=lambda s: len(s["input_ids"]))
        collate = partial(collate_packed_features, pad_id=pad_id, max_length=data_cfg.max_length)
    else:
        collate = partial(collate_features, pad_id=pad_id, max_length=data_cfg.max_length,
                          static_shapes=static_shapes, pad_multiple=pad_multiple)
    node = tn.Batcher(node, batch_size=local_batch_size, drop_last=True)
    node = tn.Mapper(node, collate)
    if pin_memory:
        node = tn.PinMemory(node)
    if data_cfg.prefetch_factor > 0:
        # snapshot_frequency=1: a snapshot per batch, so a resume never replays or loses one.
        node = tn.Prefetcher(node, prefetch_factor=data_cfg.prefetch_factor, snapshot_frequency=1)
    return FeatureDataLoader(tn.Loader(node), dp_rank=dp_rank, dp_world=dp_world, rows_per_rank=rows_per_rank,
                             source=source, shards=shards, packed=data_cfg.packing)
