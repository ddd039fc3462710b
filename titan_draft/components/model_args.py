"""A draft's model args for a job: its flavor, the job's overrides, then what the draft takes
from the target, its tokenizer and the job."""

from __future__ import annotations

import dataclasses

from titan_draft.config.job_config import JobConfig
from titan_draft.protocols import ArgsContext


def user_model_args(spec, cfg: JobConfig):
    """The flavor's args with the [model.args] overrides applied: what the user chose, before
    anything is taken from the target."""
    if cfg.model.flavor not in spec.flavors:
        raise ValueError(f"model.flavor: {cfg.model.flavor!r} is not a {spec.name} flavor ({sorted(spec.flavors)})")
    args = spec.flavors[cfg.model.flavor]
    names = {f.name for f in dataclasses.fields(args)}
    unknown = sorted(set(cfg.model.args) - names)
    if unknown:
        raise ValueError(f"model.args: unknown {spec.name} arg(s) {unknown}; known: {sorted(names)}")
    return dataclasses.replace(args, **cfg.model.args)


def resolve_model_args(spec, cfg: JobConfig, target_args, tokenizer, chat):
    """:func:`user_model_args`, then the draft's own ``update_args_fn`` (what it takes from the
    target, its tokenizer, the run's chat format and the job)."""
    args = user_model_args(spec, cfg)
    ctx = ArgsContext(target=target_args, tokenizer=tokenizer, job=cfg, chat=chat,
                      overrides=frozenset(cfg.model.args))
    return spec.update_args_fn(args, ctx)
