"""The registry of data sources: everything ``data.source`` (and ``data.feature_cache``) can name.

A :class:`DataSource` says which ``data.source`` values it claims, how it builds one DP rank's
stateful dataloader, and, where it has them, its usable samples once (what a draft's data pass and
prepare_features read) and its raw conversation rows (what the held-out split, the eval's
``holdout`` prompts, regeneration and the start-up probe read). The built-in sources (chat files,
the packaged ShareGPT, synthetic rows, a feature cache: ``builtin.py``) register like any other,
on the first lookup; a new source joins by calling :func:`register_data_source`, and the engine
never names one.

``data.feature_cache`` takes precedence over ``data.source`` for the training batches (they carry
the target's features); ``data.source`` still names the conversations behind them, which a draft's
data pass and the held-out prompts read.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

__all__ = ["FEATURE_CACHE", "DataSource", "LoaderContext", "get_data_source", "loader_source", "register_data_source",
           "source_rows"]

FEATURE_CACHE = "feature_cache"
"""The registered name of the source that ``data.feature_cache`` selects."""


@dataclass(frozen=True)
class LoaderContext:
    """What a source's dataloader is built from (the trainer, the validator and prepare_features
    fill it in)."""

    data: Any
    """The job's ``[data]`` section (``JobConfig.data``)."""
    tokenizer: Any
    """The target's tokenizer (``pad_id``, rendering)."""
    chat: Any
    """The run's resolved ``ChatFormat``."""
    dp_rank: int = 0
    dp_world: int = 1
    local_batch_size: int = 1
    seed: int = 0
    static_shapes: bool = False
    """Pad every batch to ``data.max_length`` (``training.static_shapes``)."""
    pad_multiple: int = 1
    """Without static shapes, round a batch's length up to this multiple."""
    reserved_ids: frozenset[int] = frozenset()
    """Token ids the draft reserves: rows holding one are skipped and counted."""
    warn_below_rows: int = 0
    """Warn when a rank has (or an epoch yields) fewer usable rows than this."""
    layer_ids: tuple[int, ...] = ()
    """Capture layers the draft reads (sources whose batches carry features)."""
    need_last_hidden: bool = False
    pin_memory: bool = False
    """Pin batches in the loader's thread (training on CUDA)."""
    render_workers: int = 1
    """Processes that render a counting pass of a conversation source (``epoch_samples``)."""


@dataclass(frozen=True)
class DataSource:
    """One kind of training data (module docstring)."""

    name: str
    claims: Callable[[str], bool]
    """(``data.source``) -> whether this source reads it."""
    build_loader: Callable[[LoaderContext], Any]
    """This DP rank's infinite, resumable loader of padded micro-batches (a ``RankStateLoader``:
    ``input_ids``, ``loss_mask``, ``valid_lengths``, and the features of a source that carries them)."""
    samples: Optional[Callable[[LoaderContext], Iterator[Any]]] = None
    """This DP rank's usable ``(input_ids, loss_mask)`` once, rendered and truncated as training
    renders them; None for a source without token rows of its own."""
    rows: Optional[Callable[[str], Iterator[Any]]] = None
    """(``data.source``) -> its raw conversation rows in source order; None for a source that
    has no conversations."""
    check: Optional[Callable[[str], None]] = None
    """(``data.source``) -> raise a one-line ValueError before anything loads (e.g. a missing path)."""
    probe_at_start: bool = False
    """Whether the start-up check renders the first rows (a source that is cheap to read twice)."""
    carries_features: bool = False
    """Its batches hold the target's captured features: the target does not run in training."""
    priority: int = 0
    """Among sources that claim a value, the highest wins (a catch-all such as file paths is low)."""


_REGISTRY: dict[str, DataSource] = {}
_builtins_loaded = False


def register_data_source(source: DataSource) -> None:
    if source.name in _REGISTRY:
        raise ValueError(f"data source {source.name!r} is already registered")
    _REGISTRY[source.name] = source


def _load_builtins() -> None:
    global _builtins_loaded
    if not _builtins_loaded:
        _builtins_loaded = True
        importlib.import_module("titan_draft.data.sources.builtin")


def get_data_source(source: str) -> DataSource:
    """The registered source that reads ``data.source = source``; a ValueError naming the key
    when none claims it."""
    _load_builtins()
    claiming = sorted((s for s in _REGISTRY.values() if s.claims(source)), key=lambda s: -s.priority)
    if not claiming:
        raise ValueError(f"data.source: no registered data source reads {source!r} ({sorted(_REGISTRY)})")
    return claiming[0]


def loader_source(data_cfg: Any) -> DataSource:
    """The source of a job's training batches: the feature cache when ``data.feature_cache`` is
    set, else the one that claims ``data.source``."""
    _load_builtins()
    if data_cfg.feature_cache:
        return _REGISTRY[FEATURE_CACHE]
    return get_data_source(data_cfg.source)


def source_rows(source: str) -> Iterator[Any]:
    """The raw conversation rows of ``data.source = source``; a ValueError naming the key when
    its source has none (e.g. synthetic rows)."""
    data_source = get_data_source(source)
    if data_source.rows is None:
        raise ValueError(f"data.source: {source!r} ({data_source.name}) holds no conversation rows")
    return data_source.rows(source)
