"""Offline features: ``data.feature_cache`` names a folder written by ``scripts/prepare_features.py``
and training reads the target's captured features from it instead of running the target.

Beside the online target (``target.py``) and the synthetic one (``synthetic.py``) this is the
third way to get ``TargetFeatures`` (the builder, ``builder.py``, picks one). The target is still named by ``target.path`` (or
``target.flavor``): the draft's frozen embedding and lm_head come from it, read alone from the
folder, and the manifest check compares the cache with it. Only the true-τ eval
(``eval.enable``) decodes with the target, so only then is the whole target loaded.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch import nn

from titan_draft.features.synthetic import build_synthetic_target, is_synthetic_target
from titan_draft.features.target import build_target, read_hf_config
from titan_draft.config.sources import describe_source
from titan_draft.data.features.manifest import check_cache_files, check_manifest, job_facts, load_manifest
from titan_draft.data.features.pipeline import rank_shards
from titan_draft.data.features.shards import dequantize
from titan_draft.protocols import TargetFeatures
from titan_draft.protocols.target_spec import TargetBundle, get_target_spec, target_spec_for_model_type

__all__ = ["FeatureCacheMismatchError", "TablesTarget", "build_offline_target", "check_feature_cache",
           "features_from_batch", "load_feature_cache"]

logger = logging.getLogger(__name__)


class TablesTarget(nn.Module):
    """The frozen target's two tables and its facts, without its decoder: what a draft trained on
    cached features needs of the target. ``layers`` is empty (nothing for FSDP to shard)."""

    def __init__(self, args: Any, family: str, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        self.args, self.family = args, family
        self.layers = nn.ModuleDict()
        self._embed, self._lm_head = embed, lm_head

    def capture(self, *args, **kwargs):
        raise RuntimeError("offline mode (data.feature_cache): the features come from the cache, the target is "
                           "not loaded")

    def embed_weight(self) -> torch.Tensor:
        return self._embed

    def lm_head_weight(self) -> torch.Tensor:
        return self._lm_head


def build_offline_target(cfg: Any, device: torch.device, dtype: torch.dtype, mesh=None) -> TargetBundle:
    """The target as offline training needs it: the tables alone from ``target.path``, the whole
    target when ``eval.enable`` decodes with it. A random-weight flavor (tests) is drawn whole, as
    its tables are drawn after its layers from one generator, and then dropped."""
    if cfg.eval.enable:
        logger.info("offline mode: the whole target is loaded for the true-τ eval (eval.enable)")
        return build_target(cfg, device, dtype, mesh=mesh)
    path = cfg.target.path
    if not path and is_synthetic_target(cfg.target.flavor):  # benchmarks: its tables are drawn on demand
        return build_synthetic_target(cfg, device, dtype)
    if path:
        hf_config = read_hf_config(path, backend=cfg.target.backend)
        spec = (get_target_spec("transformers") if cfg.target.backend == "transformers"
                else target_spec_for_model_type(hf_config["model_type"], os.path.join(path, "config.json")))
        if spec.load_tables is None:
            raise ValueError(f"target.path: target family {spec.family!r} cannot read its tables alone "
                             "(TargetSpec.load_tables), which offline training needs")
        args = spec.args_from_hf_config(hf_config)
        embed, lm_head = spec.load_tables(path, args)
        family, source = spec.family, path
    else:
        full = build_target(cfg, torch.device("cpu"), dtype)
        args, family, source = full.args, full.family, full.source
        embed, lm_head = full.model.embed_weight(), full.model.lm_head_weight()
    tied = lm_head.data_ptr() == embed.data_ptr()
    embed = embed.to(device=device, dtype=dtype)
    lm_head = embed if tied else lm_head.to(device=device, dtype=dtype)
    return TargetBundle(model=TablesTarget(args, family, embed, lm_head), args=args, family=family, source=source)


class FeatureCacheMismatchError(ValueError):
    """The cache holds another job's features (a fact that needs the target or the draft to know,
    found once the trainer is being built); the message is the one line naming the job field."""


def check_feature_cache(cfg: Any) -> None:
    """Before any process group: the cache has a complete manifest and every shard it lists, at its
    recorded size. (The job-facts check and the checksums need the draft and run per rank.)"""
    if not cfg.data.feature_cache:
        return
    manifest = load_manifest(cfg.data.feature_cache)
    cached = manifest.get("facts", {}).get("max_length")
    if cached is not None and cached != cfg.data.max_length:  # the one job fact known without the target
        raise ValueError(f"data.max_length: {cfg.data.feature_cache} was captured with max_length {cached}, this "
                         f"job has {cfg.data.max_length}{describe_source(cfg, 'data.max_length')}: set "
                         f"data.max_length = {cached}, or prepare the cache again")
    check_cache_files(cfg.data.feature_cache, manifest["shards"], verify=False)


def load_feature_cache(cfg: Any, target: TargetBundle, tokenizer: Any, chat: Any, *, layer_ids: list[int],
                       need_last_hidden: bool, reserved_ids: list[int], dp_rank: int, dp_world: int) -> dict[str, Any]:
    """The cache's manifest, once it is known to hold this job's features (target, tokenizer,
    template, max_length, capture layers, last hidden, reserved tokens) and this rank's shards
    are whole (sha256 with ``data.feature_cache_verify``); a one-line ValueError otherwise."""
    folder = cfg.data.feature_cache
    manifest = load_manifest(folder)
    facts = job_facts(cfg, target.args, tokenizer, chat, layer_ids, need_last_hidden, reserved_ids)
    try:
        check_manifest(manifest, facts, os.path.join(folder, "manifest.json"))
    except ValueError as e:
        raise FeatureCacheMismatchError(str(e)) from None
    if manifest["facts"]["data"] != facts["data"]:
        # offline, data.source feeds only a draft's data pass (EAGLE-3's vocabulary) and the eval's
        # held-out prompts; a cache moved to another machine legitimately names another path
        logger.warning(f"data.feature_cache: the cache's rows came from {manifest['facts']['data']}, this job "
                       f"names {facts['data']} (used offline only by a draft's data pass and eval prompts)")
    check_cache_files(folder, manifest["shards"], verify=False)
    if cfg.data.feature_cache_verify:
        check_cache_files(folder, rank_shards(manifest["shards"], dp_rank, dp_world), verify=True)
    return manifest


def features_from_batch(batch: dict[str, torch.Tensor], dtype: torch.dtype) -> TargetFeatures:
    """A feature batch (already on device) as the ``TargetFeatures`` the online target would give,
    in the target's dtype; float8 storage is scaled back here, on the device."""
    last = batch.get("last_hidden")
    return TargetFeatures(
        input_ids=batch["input_ids"],
        loss_mask=batch["loss_mask"],
        valid_lengths=batch["valid_lengths"],
        aux_hidden=dequantize(batch["aux_hidden"], batch.get("aux_scale"), dtype),
        last_hidden=None if last is None else dequantize(last, batch.get("last_scale"), dtype),
        document_ids=batch.get("document_ids"),
    )
