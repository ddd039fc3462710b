"""What the online (``ChatDataLoader``) and offline (``FeatureDataLoader``) loaders share: iteration
over a torchdata Loader, the per-rank ``state_dict`` layout, the load (with or without a DP change)
and the counters read from the source node's state.

The state follows torchtitan: the pickled Loader state under ``dp_rank_{r}`` (so DCP keeps every
rank's copy) next to ``world_size``. Because every rank's part has a key of its own, the parts of
all saved ranks merge into one dict; ``load_state_dict`` given such a dict with another
``world_size`` asks the loader to move the position to this DP size (``_resharded``), which a
loader may refuse.

``close`` stops the prefetch threads and waits for them. A daemon thread still inside a torch call
when the interpreter exits is killed there, which aborts the process ("terminate called without
an active exception", then a segfault): seen at the end of a 2-rank CPU run that had finished and
saved, once in about four.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any, Optional

import torch
import torchdata.nodes as tn

from titan_draft.data.sources.rows import SKIP_REASONS
from titan_draft.data.worker_errors import ForwardErrorsNode
from titan_draft.logger import logger

__all__ = ["RankStateLoader", "find_source_state", "replace_source_state", "stop_threads"]

# How long close() waits for a prefetch thread: it stops between items, and one item is a batch
# of tokenized rows (milliseconds) or of feature-cache reads (well under a second).
THREAD_STOP_TIMEOUT_S = 60.0


def _threaded_nodes(root: tn.BaseNode):
    """The nodes from ``root`` down its chain of sources that run a thread of their own."""
    node: Any = root
    while isinstance(node, tn.BaseNode):
        if isinstance(node, (tn.Prefetcher, tn.PinMemory)):
            yield node
        node = getattr(node, "source", None)  # every torchdata node (and ours) keeps its input there


def stop_threads(root: tn.BaseNode, timeout_s: float = THREAD_STOP_TIMEOUT_S) -> None:
    """Stop the prefetch / pin-memory threads of the pipeline under ``root`` and wait for them.

    torchdata has no public call for this (its own ``__del__`` joins for half a second), hence
    the private ``_it`` / ``_shutdown`` / ``_thread``; tests/unit/data/test_data_threads.py pins them."""
    for node in _threaded_nodes(root):
        mapper = node._it
        if mapper is None:
            continue
        mapper._shutdown()  # sets the stop event, joins briefly
        mapper._thread.join(timeout=timeout_s)
        if mapper._thread.is_alive():
            logger.warning(f"data: the {type(node).__name__} thread did not stop within {timeout_s:.0f} s")


def find_source_state(state: Any, key: str) -> Optional[dict[str, Any]]:
    """The source node's state (under ``key``) nested somewhere in a Loader state (torchdata's layout)."""
    if isinstance(state, dict):
        if key in state:
            return state[key]
        for value in state.values():
            found = find_source_state(value, key)
            if found is not None:
                return found
    return None


def replace_source_state(state: Any, key: str, source_state: dict[str, Any]) -> bool:
    """Put ``source_state`` in place of the one under ``key`` (in place); whether it was found."""
    if isinstance(state, dict):
        if key in state:
            state[key] = source_state
            return True
        return any(replace_source_state(value, key, source_state) for value in state.values())
    return False


class RankStateLoader:
    """Infinite, resumable iterator of batches for one DP rank.

    Args:
        loader: the Loader over the pipeline.
        source_key: the key of the source node's state inside the Loader state (the node may run
            ahead in the Prefetcher's thread, so its consumed position is read from the Loader
            state, never from the node itself).
        dp_rank, dp_world: this rank's index and the DP size.
        rows_per_rank: rows one epoch of a rank reads.
        worker: the node that keeps the prefetch thread's failure, to raise it as it was.
    """

    def __init__(self, loader: tn.Loader, *, source_key: str, dp_rank: int, dp_world: int, rows_per_rank: int,
                 worker: Optional[ForwardErrorsNode] = None):
        self._loader = loader
        self._source_key = source_key
        self._worker = worker
        self._it: Optional[Any] = None
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.rows_per_rank = rows_per_rank

    @property
    def _rank_key(self) -> str:
        return f"dp_rank_{self.dp_rank}"

    def __iter__(self) -> "RankStateLoader":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._it is None:
            self._it = iter(self._loader)
        try:
            return next(self._it)
        except Exception:
            if self._worker is not None and self._worker.failure is not None:
                raise self._worker.failure  # the one-line error, not torchdata's re-wrapped copy
            raise

    def close(self) -> None:
        """Stop the pipeline's threads (module docstring): the last call on this loader."""
        stop_threads(self._loader.root)

    def state_dict(self) -> dict[str, Any]:
        return {self._rank_key: pickle.dumps(self._loader.state_dict()), "world_size": self.dp_world}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_world = state_dict.get("world_size")
        if not isinstance(saved_world, int) or saved_world < 1:
            raise ValueError(f"data: the dataloader state records no DP size (world_size = {saved_world!r})")
        keys = [self._rank_key] if saved_world == self.dp_world else [f"dp_rank_{r}" for r in range(saved_world)]
        missing = [k for k in keys if k not in state_dict]
        if missing:
            raise ValueError(
                f"data: the dataloader state of {saved_world} DP ranks has no entry for {', '.join(missing)}")
        if saved_world == self.dp_world:
            state = pickle.loads(state_dict[self._rank_key])
        else:
            state = self._resharded([pickle.loads(state_dict[k]) for k in keys])
        # A fresh Loader: torchdata's Loader ignores a loaded state when its state_dict() was
        # called before any iter() (DCP does exactly that to learn the structure it loads into).
        self._loader = tn.Loader(self._loader.root)
        self._loader.load_state_dict(state)
        # Apply it now, so a state_dict() taken before the next batch returns the loaded state.
        self._it = iter(self._loader)

    def _resharded(self, saved: list[dict[str, Any]]) -> dict[str, Any]:
        """This rank's Loader state continuing the run whose ranks saved ``saved`` (another DP size);
        a loader that can move its position overrides this refusal (with :meth:`_saved_sources`
        and :meth:`_with_source`)."""
        raise ValueError(
            f"data: the dataloader state was saved with {len(saved)} DP ranks, this run has {self.dp_world}, and "
            f"{type(self).__name__} cannot move its position to another DP size; resume with {len(saved)} DP ranks, "
            "or set checkpoint.reset_data_position = true to keep the weights, optimizer and step and start the "
            "data afresh")

    def _saved_sources(self, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The source node's state in each saved rank's Loader state."""
        sources = [find_source_state(s, self._source_key) for s in saved]
        if any(s is None for s in sources):
            raise ValueError(f"data: a saved dataloader state holds no {self._source_key} state")
        return sources

    def _with_source(self, layout: dict[str, Any], source_state: dict[str, Any]) -> dict[str, Any]:
        """A copy of the Loader state ``layout`` (any saved rank's: the pipeline around the source
        is the same on every rank) with ``source_state`` as its source node's state."""
        state = copy.deepcopy(layout)
        replace_source_state(state, self._source_key, source_state)
        return state

    def _source_state(self) -> dict[str, Any]:
        state = find_source_state(self._loader.state_dict(), self._source_key)
        assert state is not None, f"{self._source_key} state not found in the Loader state"
        return state

    def _counts(self, name: str) -> dict[str, int]:
        counts = self._source_state().get(name, {})  # a source that skips nothing keeps none
        return {reason: counts.get(reason, 0) for reason in SKIP_REASONS}

    @property
    def skip_counts(self) -> dict[str, int]:
        """Rows skipped so far per reason (every reason, zeros included, so logged series are
        stable), up to the last batch handed out; cumulative over epochs (zero for a feature
        cache: prepare_features skipped and logged its unusable rows)."""
        return self._counts("skip_counts")

    @property
    def epoch_skip_counts(self) -> dict[str, int]:
        """Rows skipped per reason in the current epoch (up to the last batch handed out): what a
        pass over the data really rejects, not counted again each time a bad row comes round."""
        return self._counts("epoch_skip_counts")

    @property
    def epoch(self) -> int:
        """Epoch (0-based) of the next row this rank will read."""
        return self._source_state()["epoch"]
