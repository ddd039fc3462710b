"""The one place that decides where a training step's ``TargetFeatures`` come from.

- **online**: the frozen target (``target.py``) runs on every micro-batch, replayed as a CUDA
  graph where it can be (``graphed_capture.py``);
- **offline**: the job's data source carries the features (a feature cache): the target's tables
  are read alone and the features come with the batch (``offline.py``);
- **synthetic**: ``target.flavor = "synthetic:<flavor>"`` draws random features of the right
  shape, for benchmarks (``synthetic.py``).

The trainer calls :func:`build_features` once, then :meth:`FeatureSource.bind` once the draft's
capture layers are known.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from titan_draft.data.sources.registry import loader_source
from titan_draft.features.graphed_capture import maybe_graphed_capture
from titan_draft.features.offline import build_offline_target, features_from_batch, load_feature_cache
from titan_draft.features.synthetic import SyntheticTarget
from titan_draft.features.target import build_target, compute_features
from titan_draft.protocols import TargetFeatures
from titan_draft.protocols.target_spec import TargetBundle

__all__ = ["FeatureSource", "build_features"]

logger = logging.getLogger(__name__)


class FeatureSource:
    """The job's frozen target and how a micro-batch becomes ``TargetFeatures``."""

    def __init__(self, cfg: Any, target: TargetBundle, mode: str, dtype: torch.dtype):
        self.cfg, self.target, self.mode, self.dtype = cfg, target, mode, dtype
        self.manifest: dict | None = None
        """The feature cache's checked manifest (offline, after ``bind``)."""
        self.features_fn: Callable[[dict[str, torch.Tensor]], TargetFeatures] | None = None

    @property
    def offline(self) -> bool:
        return self.mode == "offline"

    def bind(self, *, tokenizer: Any, chat: Any, layer_ids: list[int], need_last_hidden: bool,
             reserved_ids: list[int], dp_rank: int, dp_world: int) -> Callable[[dict[str, torch.Tensor]], TargetFeatures]:
        """micro-batch -> ``TargetFeatures`` for a draft that reads ``layer_ids``. Offline, the cache
        is checked first: one that holds other features is refused (a one-line ValueError) before
        the draft's data pass and its model."""
        if self.offline:
            self.manifest = load_feature_cache(
                self.cfg, self.target, tokenizer, chat, layer_ids=layer_ids, need_last_hidden=need_last_hidden,
                reserved_ids=reserved_ids, dp_rank=dp_rank, dp_world=dp_world)
            dtype = self.dtype
            self.features_fn = lambda batch: features_from_batch(batch, dtype)
            return self.features_fn
        model = self.target.model
        if self.mode == "online":
            device = next(model.parameters()).device
            model, line = maybe_graphed_capture(model, device, enable=self.cfg.target.cuda_graph,
                                                static_shapes=self.cfg.training.static_shapes)
            logger.info(line)
        self.features_fn = lambda batch: compute_features(model, batch, layer_ids, need_last_hidden)
        return self.features_fn

    def describe(self) -> str:
        """What run_info.json records as the features' origin."""
        if self.offline:
            return f"offline: {self.cfg.data.feature_cache} ({self.manifest['storage']})"
        return "online"


def build_features(cfg: Any, device: torch.device, dtype: torch.dtype, mesh=None) -> FeatureSource:
    """The job's target on ``device`` in ``dtype`` (sharded over ``mesh``), loaded as its features'
    origin needs it: whole online, its tables alone offline (whole when ``eval.enable`` decodes
    with it)."""
    if loader_source(cfg.data).carries_features:
        return FeatureSource(cfg, build_offline_target(cfg, device, dtype, mesh=mesh), "offline", dtype)
    target = build_target(cfg, device, dtype, mesh=mesh)
    mode = "synthetic" if isinstance(target.model, SyntheticTarget) else "online"  # its features need no graph
    return FeatureSource(cfg, target, mode, dtype)
