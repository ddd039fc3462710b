"""The built-in data sources, registered on the registry's first lookup (registry.py).

- ``files``: a .json / .jsonl file or a folder of them (any path; the catch-all);
- ``sharegpt``: the packaged ShareGPT V3 dump (``data.source = "sharegpt"``);
- ``synthetic``: token rows made in memory for benchmarks (``"synthetic:<mode>"``, synthetic.py);
- ``feature_cache``: a folder of captured target features (``data.feature_cache``,
  ``titan_draft/data/features/``).
"""

from __future__ import annotations

from typing import Any

from titan_draft.data.pipeline import build_chat_loader, build_rows_loader, chat_samples
from titan_draft.data.sources.files import check_path, iter_path, iter_sharegpt
from titan_draft.data.sources.registry import FEATURE_CACHE, DataSource, LoaderContext, register_data_source
from titan_draft.data.sources.synthetic import build_synthetic_source, is_synthetic_source


def _synthetic_node(ctx: LoaderContext):
    return build_synthetic_source(ctx.data, dp_rank=ctx.dp_rank, dp_world=ctx.dp_world, seed=ctx.seed)


def _feature_cache_loader(ctx: LoaderContext) -> Any:
    from titan_draft.data.features.manifest import load_manifest
    from titan_draft.data.features.pipeline import build_feature_dataloader

    folder = ctx.data.feature_cache
    return build_feature_dataloader(
        folder, load_manifest(folder)["shards"], data_cfg=ctx.data, pad_id=ctx.tokenizer.pad_id, dp_rank=ctx.dp_rank,
        dp_world=ctx.dp_world, local_batch_size=ctx.local_batch_size, seed=ctx.seed, static_shapes=ctx.static_shapes,
        pad_multiple=ctx.pad_multiple, layer_ids=list(ctx.layer_ids), need_last_hidden=ctx.need_last_hidden,
        pin_memory=ctx.pin_memory)


register_data_source(DataSource(
    name="files", claims=lambda source: True, priority=-1, build_loader=build_chat_loader, samples=chat_samples,
    rows=iter_path, check=check_path, probe_at_start=True))
register_data_source(DataSource(
    name="sharegpt", claims=lambda source: source == "sharegpt", build_loader=build_chat_loader,
    samples=chat_samples, rows=iter_sharegpt))
register_data_source(DataSource(
    name="synthetic", claims=is_synthetic_source,
    build_loader=lambda ctx: build_rows_loader(_synthetic_node(ctx), ctx),
    samples=lambda ctx: _synthetic_node(ctx).usable_samples()))
register_data_source(DataSource(
    name=FEATURE_CACHE, claims=lambda source: False, build_loader=_feature_cache_loader, carries_features=True))
