"""The ``[validation]`` section: the draft's training figures on held-out rows.

The loss, accuracy and simulated accept_len that training logs come from its own batches. On a
small regenerated set those rows are seen several times, and the figures then overstate what
unseen prompts get: on the H200 a DFlash2 draft read accept_len 4.6 on training batches while
real speculative decoding measured tau 1.8 on MT-Bench. The validator runs the same forward,
without a gradient, over the first ``data.holdout_rows`` rows of ``data.source`` (which training
never reads) and logs them as ``val/*``: the honest training-time proxy, beside the true tau of
``[eval]``.

Every validation reads the same batches (the held-out rows in source order, no shuffle) with the
same anchor draws (a generator seeded by batch index), so its values form a curve.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, Iterable

import torch

from titan_draft.components.metrics import StepSums, due_every, metric_ratios
from titan_draft.data.pipeline import build_dataloader

logger = logging.getLogger(__name__)


@torch.no_grad()
def validate(model, features_fn: Callable, batches: Iterable[dict], device: torch.device, *,
             seed: int, all_reduce: Callable[[torch.Tensor], None] | None = None) -> dict[str, float]:
    """``{"val/loss": .., "val/<metric>": ..}`` of ``model`` over ``batches``: the sums of loss
    and of every metric's numerator and denominator over all batches (and ranks, through
    ``all_reduce``), divided at the end, as training's logged figures are."""
    sums = StepSums(device)
    for i, batch in enumerate(batches):
        batch = {k: v.to(device) for k, v in batch.items()}
        g = torch.Generator(device=device).manual_seed(seed + i)
        sums.add(model(features_fn(batch), generator=g))
    flat, names = sums.flat()
    if all_reduce is not None:
        all_reduce(flat)
    values = flat.tolist()
    ratios = metric_ratios(values, names)
    return {"val/loss": values[0] / max(values[1], 1e-12), **{f"val/{k}": v for k, v in ratios.items()}}


class Validator:
    """Held-out batches and when to measure them (module docstring)."""

    def __init__(self, cfg, tokenizer, chat, device: torch.device, *, dp_rank: int, dp_world: int,
                 reserved_ids: frozenset[int] = frozenset(), pad_multiple: int = 1):
        self.cfg, self.device, self.dp_world = cfg, device, dp_world
        self.enabled = cfg.validation.enable
        if not self.enabled:
            return
        t = cfg.training
        # the held-out rows only: the first data.holdout_rows, in source order
        held_out = replace(cfg.data, holdout_rows=0, max_rows=cfg.data.holdout_rows, shuffle=False, prefetch_factor=0)
        # a held-out split without a usable row fails here, before training. The batches are the
        # same at every validation, so they are read and collated once and kept (a few MB of ids)
        self._build = lambda: build_dataloader(
            held_out, tokenizer, chat=chat, dp_rank=dp_rank, dp_world=dp_world, local_batch_size=t.local_batch_size,
            seed=t.seed, static_shapes=t.static_shapes, pad_multiple=pad_multiple, reserved_ids=reserved_ids)
        loader = iter(self._build())
        self._batches = [next(loader) for _ in range(cfg.validation.steps)]
        del loader

    def should_run(self, step: int, total_steps: int) -> bool:
        return self.enabled and due_every(step, total_steps, self.cfg.validation.freq)

    def run(self, model, features_fn: Callable, step: int) -> dict[str, float]:
        """The ``val/*`` scalars at ``step`` (collective under data parallelism)."""
        reduce = torch.distributed.all_reduce if self.dp_world > 1 else None
        values = validate(model, features_fn, self._batches, self.device, seed=self.cfg.training.seed, all_reduce=reduce)
        logger.info(f"validation at step {step} ({self.cfg.validation.steps} held-out batches per rank): "
                    + "  ".join(f"{k.removeprefix('val/')} {v:.4f}" for k, v in values.items()))
        return values
