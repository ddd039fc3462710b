"""Helpers of the reliability tests: a tiny job against the random target, and fault injection."""

from __future__ import annotations

import torch

from trainer_runs import REPO, debug_job_argv  # noqa: F401  (REPO: the tests import it from here)


def job_args(dump, data: str, target: str, *extra: str) -> list[str]:
    """The debug_random job shrunk to seconds: short rows, no TensorBoard, no profiler."""
    return debug_job_argv("dflash2", dump, target, data, "--data.max_rows", "0", "--training.local_batch_size", "2",
                          *extra, max_length=64)


def poison_features(monkeypatch, trainer, steps) -> None:
    """Make the target's captured hidden states NaN at the given optimizer steps (a diverging
    target or bad data row): the draft's loss and gradients become NaN there."""
    real = trainer.features_fn

    def poisoned(*args, **kwargs):
        features = real(*args, **kwargs)
        if trainer.train_state.step in steps:
            features.aux_hidden = torch.full_like(features.aux_hidden, float("nan"))
        return features

    monkeypatch.setattr(trainer, "features_fn", poisoned)


def weights(trainer) -> dict[str, torch.Tensor]:
    """A plain copy of the draft's trainable weights (one rank: the local shard is the whole)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in trainer.model.named_parameters() if p.requires_grad}
