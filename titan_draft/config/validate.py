"""Semantic checks of a parsed JobConfig (the DESIGN.md and seed rules)."""

from __future__ import annotations

import logging
import os
from typing import Any

from titan_draft.config.job_config import TARGET_BACKENDS, JobConfig
from titan_draft.config.sources import describe_source
from titan_draft.data.chat.template import SUPPORTED_TEMPLATES

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad key or value in a job config. The message names the key and where it came from."""


_DTYPES = ("bfloat16", "float16", "float32")
_CHOICES = {
    "job.device": ("auto", "cuda", "cpu"),
    "training.mixed_precision_param": _DTYPES,
    "training.mixed_precision_reduce": _DTYPES,
    "target.dtype": _DTYPES,
    "target.backend": TARGET_BACKENDS,
    "checkpoint.export_dtype": _DTYPES,
    "optimizer.implementation": ("auto", "fused", "foreach", "for-loop"),
    "lr_scheduler.decay_type": ("cosine", "linear", "constant"),
    "parallelism.fsdp_reshard_after_forward": ("default", "always", "never"),
    "activation_checkpoint.mode": ("none", "full"),
    "data.chat_template": ("auto", *SUPPORTED_TEMPLATES),
    "training.nonfinite": ("stop", "skip"),
}
# key -> smallest allowed value
_MINIMUM = {
    "training.local_batch_size": 1, "training.grad_accum_steps": 1, "training.epochs": 0,
    "training.max_norm": 0, "data.max_length": 1, "data.packing_window": 1, "data.max_rows": 0, "data.prefetch_factor": 0,
    "optimizer.lr": 0, "optimizer.eps": 0, "optimizer.weight_decay": 0,
    "lr_scheduler.warmup_steps": -1, "lr_scheduler.warmup_ratio": 0, "lr_scheduler.min_lr_factor": 0,
    "checkpoint.interval": 1, "checkpoint.keep_latest_k": 0, "checkpoint.load_step": -1,
    "metrics.log_freq": 1, "profiling.profile_freq": 1, "profiling.profile_active": 1,
    "profiling.profile_warmup": 0, "comm.init_timeout_seconds": 1, "comm.train_timeout_seconds": 1,
    "target.seed": 0, "data.holdout_rows": 0, "eval.interval": 0, "eval.num_prompts": 0,
    "eval.max_new_tokens": 1, "eval.max_prompt_tokens": 0,
    "training.nonfinite_max_skips": 1, "validation.freq": 0, "validation.steps": 1,
}


def _get(cfg: JobConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def validate_job_config(cfg: JobConfig, log: logging.Logger | None = None) -> list[str]:
    """Check the combination of values. Raises ConfigError naming every bad key; logs and returns
    the warnings (legal combinations that are likely to disappoint)."""
    log = log or logger
    errors: list[str] = []
    warnings: list[str] = []
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            errors.append(f"{key} = {_get(cfg, key)!r} must be one of {', '.join(choices)}")
    for key, low in _MINIMUM.items():
        if _get(cfg, key) < low:
            errors.append(f"{key} = {_get(cfg, key)!r} must be >= {low}")
    if cfg.training.epochs == 0 and cfg.training.steps < 1:
        errors.append(f"training.steps = {cfg.training.steps} must be >= 1 (or set training.epochs)")
    for key in ("optimizer.beta1", "optimizer.beta2", "lr_scheduler.warmup_ratio",
                "lr_scheduler.min_lr_factor"):
        if not 0 <= _get(cfg, key) <= 1:
            errors.append(f"{key} = {_get(cfg, key)!r} must be in [0, 1]")
    dp = cfg.parallelism.data_parallel_shard_degree
    if dp != -1 and dp < 1:
        errors.append(f"parallelism.data_parallel_shard_degree = {dp} must be -1 or >= 1")
    layers = cfg.target.capture_layers
    if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
        errors.append(f"target.capture_layers = {layers} must be distinct non-negative layer ids")

    if cfg.optimizer.name.lower() != "adamw":
        errors.append(f"optimizer.name = {cfg.optimizer.name!r}{describe_source(cfg, 'optimizer.name')} "
                      "is not an optimizer titan_draft builds (supported: AdamW)")
    if cfg.eval.enable and "mtbench" in cfg.eval.prompts:
        from titan_draft.data.chat.prompts import mtbench_questions

        try:
            mtbench_questions()  # reads one small file of the package: no target needed
        except ValueError as e:
            errors.append(f"eval.enable: {e} (or set eval.prompts to 'holdout' or .jsonl files, or eval.enable "
                          "= false)")
    if cfg.validation.enable and cfg.data.holdout_rows <= 0:
        errors.append("validation.enable needs held-out rows to validate on: set data.holdout_rows > 0")
    if cfg.validation.enable and cfg.data.feature_cache:
        errors.append("validation.enable is not available with data.feature_cache (held-out rows are read "
                      "from data.source and need the target online)")

    if cfg.target.backend == "transformers":
        if cfg.data.packing:
            errors.append("data.packing is not available with target.backend = 'transformers' (a family's own "
                          "attention may not keep packed documents apart): set data.packing = false")
        if not cfg.target.path:
            errors.append("target.backend = 'transformers' reads a checkpoint folder: set target.path")
    if cfg.data.packing and cfg.data.max_length % 128:
        errors.append(f"data.max_length = {cfg.data.max_length} must be a multiple of 128 with data.packing "
                      "(the attention tile of the document masks)")
    static = cfg.training.static_shapes
    if cfg.float8.enable and static and cfg.data.max_length % 16 != 0:
        errors.append(f"data.max_length = {cfg.data.max_length} must be a multiple of 16 with "
                      "float8.enable and training.static_shapes (float8 GEMMs need token counts "
                      "divisible by 16)")
    if cfg.compile.enable and not static:
        warnings.append("compile.enable without training.static_shapes: every new padded batch "
                        "shape recompiles the blocks (dynamic-shape graphs give back the gain, and "
                        "flex_attention may fail to lower with a symbolic length); "
                        "set training.static_shapes = true for real data")
    if cfg.float8.enable and not static:
        warnings.append("float8.enable without training.static_shapes: float8 GEMMs need token "
                        "counts divisible by 16 and pad-to-longest batches usually are not "
                        "('Expected ... to be divisible by 16'); set training.static_shapes = true")
    if not cfg.data.enable_thinking and cfg.data.chat_template not in ("qwen3", "auto"):
        warnings.append(f"data.enable_thinking = false has no effect with data.chat_template = "
                        f"{cfg.data.chat_template!r} (only 'qwen3' has a thinking mode)")
    if cfg.float8.enable and not cfg.compile.enable:
        warnings.append("float8.enable without compile.enable: eager float8 dynamic scaling is "
                        "slower than bf16; enable both")
    if errors:
        raise ConfigError("invalid job config: " + "; ".join(errors))
    for w in warnings:
        log.warning(w)
    return warnings


def validate_launch(cfg: JobConfig, world_size: int | None = None) -> None:
    """Check the job against how it was launched, before any process group or model: a CUDA
    device that is not there, data-parallel degrees that do not multiply to the number of ranks
    (``WORLD_SIZE``, 1 without a launcher). Raises ConfigError naming the key."""
    import torch

    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    errors = []
    if cfg.job.device == "cuda" and not torch.cuda.is_available():
        errors.append(f"job.device = 'cuda'{describe_source(cfg, 'job.device')} but no CUDA device is visible to "
                      "this process (set job.device = 'auto' or 'cpu', or check CUDA_VISIBLE_DEVICES)")
    p = cfg.parallelism
    replicate, shard = p.data_parallel_replicate_degree, p.data_parallel_shard_degree
    launched = f"{world_size} rank{'s' if world_size != 1 else ''} launched"
    hint = "launch that many ranks (NGPU=... ./run_train.sh, torchrun --nproc_per_node) or set -1"
    if replicate < 1 or world_size % replicate:
        errors.append(f"parallelism.data_parallel_replicate_degree = {replicate}"
                      f"{describe_source(cfg, 'parallelism.data_parallel_replicate_degree')} must divide the "
                      f"{launched}")
    elif shard != -1 and shard * replicate != world_size:
        errors.append(f"parallelism.data_parallel_shard_degree = {shard}"
                      f"{describe_source(cfg, 'parallelism.data_parallel_shard_degree')} times "
                      f"data_parallel_replicate_degree = {replicate} is {shard * replicate}, but {launched}: {hint}")
    if errors:
        raise ConfigError("invalid job config: " + "; ".join(errors))
