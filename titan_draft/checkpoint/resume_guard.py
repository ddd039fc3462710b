"""The resume guard: a saved data position is only resumed under the job keys that give it its meaning.

A dataloader state is "epoch e, row r of this rank's shuffled rows, skip counts so far". Another
``data.max_length`` changes which rows are usable, another batch size or DP size changes which
samples a step reads, another source, template or seed changes the rows themselves: a resume under
any of them would go on silently from a position that points somewhere else. So each checkpoint
holds ``data_keys.json`` (written before DCP's files, so a complete checkpoint always has it, and
covered by the integrity record), and a resume compares it with the job's:

- equal: resume everything;
- only the split of the global batch differs (the DP size, ``training.local_batch_size``,
  ``training.grad_accum_steps``, their product unchanged): a step still reads as many samples, so
  the step count is still a global sample count; the dataloader then moves the position to the
  new DP size where that is exact, or refuses (data/reshard.py);
- different: refuse, naming every key with its saved and its new value; or, with
  ``checkpoint.reset_data_position``, resume the weights, optimizer, lr schedule and step and start
  the data afresh (epoch 0, row 0), saying so.

The optimizer and the lr schedule get the same treatment from ``optimizer_keys.json`` (the second
half of this file): another lr, beta, eps, weight decay, kernel, warm-up, decay or schedule length
is refused, naming the keys, or applied to the restored optimizer and schedule with
``checkpoint.apply_new_optimizer_settings``, one log line per key with its old and new value.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

DATA_KEYS = "data_keys.json"


class ResumeRefusedError(ValueError):
    """A checkpoint that this job cannot resume as it is (its data position would mean something
    else, or cannot move to this DP size): the CLI prints it as one line."""


# How held-out rows are split off (data/sources/rows.py: split_rows). Versions before this one kept the
# later rows that repeat a held-out prompt, so their saved positions count rows differently.
HOLDOUT_SPLIT = "held-out rows and later rows asking their prompts"


def build_data_keys(cfg, *, chat: Any, dp_world: int) -> dict[str, Any]:
    """The job keys a data position depends on (``chat``: the run's resolved ``ChatFormat``)."""
    d, t = cfg.data, cfg.training
    split = {"data.holdout_split": HOLDOUT_SPLIT} if d.holdout_rows else {}
    # absent when off, so positions saved before packing existed still compare equal
    packing = {"data.packing": True, "data.packing_window": d.packing_window} if d.packing else {}
    return {**split, **packing,
        "data.source": d.source,
        "data.max_rows": d.max_rows,
        "data.holdout_rows": d.holdout_rows,
        "data.max_length": d.max_length,
        "data.shuffle": d.shuffle,
        "data.chat_template": chat.template,
        "data.system_prompt": chat.system_prompt,
        "data.enable_thinking": chat.enable_thinking,
        "data.last_turn_only": chat.last_turn_only,
        "training.local_batch_size": t.local_batch_size,
        "training.grad_accum_steps": t.grad_accum_steps,
        "training.seed": t.seed,
        "data-parallel ranks": dp_world,
    }


# The keys whose product is the global batch (samples per optimizer step).
BATCH_SPLIT = ("training.local_batch_size", "training.grad_accum_steps", "data-parallel ranks")


def _global_batch(keys: dict[str, Any]) -> int | None:
    values = [keys.get(k) for k in BATCH_SPLIT]
    return None if any(not isinstance(v, int) for v in values) else values[0] * values[1] * values[2]


def write_data_keys(path: str, keys: dict[str, Any]) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, DATA_KEYS), "w") as f:
        json.dump(keys, f, indent=1)


def _short(v: Any) -> str:
    text = json.dumps(v)  # long values are system prompts; paths stay whole
    return text if len(text) <= 200 else text[:197] + '..."'


def check_data_keys(path: str, keys: dict[str, Any] | None, reset: bool) -> bool:
    """Compare the checkpoint ``path``'s data keys with this job's ``keys``. Returns whether the
    saved data position must be left out of the load (``reset`` and a difference). Raises
    ValueError naming the keys on a difference without ``reset``."""
    file = os.path.join(path, DATA_KEYS)
    if keys is None:
        return False
    if not os.path.isfile(file):
        logger.warning("checkpoint: %s has no %s (an older version saved it): the job keys of its data "
                       "position cannot be compared", path, DATA_KEYS)
        return reset
    with open(file) as f:
        saved = json.load(f)
    diff = [k for k in keys if saved.get(k) != keys[k]]
    batch, saved_batch = _global_batch(keys), _global_batch(saved)
    if batch is not None and batch == saved_batch and set(diff) & set(BATCH_SPLIT):
        # the same samples a step, split otherwise: not a change of what a step means
        logger.info("checkpoint: %s splits its global batch of %d samples as %s (local batch x accumulation x DP), "
                    "this job as %s: the step count resumes as a global sample count", path, batch,
                    " x ".join(str(saved[k]) for k in BATCH_SPLIT), " x ".join(str(keys[k]) for k in BATCH_SPLIT))
        resplit, diff = True, [k for k in diff if k not in BATCH_SPLIT]
    else:
        resplit = False
    if not diff and not (resplit and reset):
        return False
    if not diff:  # reset asked for: the data starts afresh instead of being moved to the new split
        logger.warning("checkpoint: checkpoint.reset_data_position: resuming the weights, optimizer and step, the "
                       "data starts from the beginning")
        return True
    changes = ", ".join(f"{k} {_short(saved.get(k))} -> {_short(keys[k])}" for k in diff)
    if not reset:
        split_note = ""
        if set(diff) & set(BATCH_SPLIT) and saved_batch is not None:
            split_note = (f"local_batch_size, grad_accum_steps and the DP size may change when their product (the "
                          f"global batch) stays {saved_batch}; ")
        raise ResumeRefusedError(
            f"checkpoint {path}: this job changes what its data position means ({changes}); {split_note}resume "
            f"with the saved values, or set checkpoint.reset_data_position = true to keep the weights, "
            f"optimizer and step and start the data from the beginning")
    logger.warning("checkpoint: %s; checkpoint.reset_data_position: resuming the weights, optimizer and "
                   "step, the data starts from the beginning", changes)
    return True


# ---- the optimizer and the lr schedule ------------------------------------------------------------
#
# A load replaces the optimizer's param groups with the saved ones (lr, betas, eps, weight decay,
# kernel flags) and the schedule's base lr with the saved peak, while the schedule's curve (warm-up,
# decay, length) is rebuilt from the job. Left alone, a changed setting would either be dropped
# without a word or bend the curve mid-run; so the checkpoint records them in ``optimizer_keys.json``
# and a resume under other values is refused, or applied with checkpoint.apply_new_optimizer_settings.

OPTIMIZER_KEYS = "optimizer_keys.json"
APPLY_FLAG = "checkpoint.apply_new_optimizer_settings"


def build_optimizer_keys(cfg, device_type: str, total_steps: int) -> dict[str, Any]:
    """The job's optimizer and schedule settings as they act on ``device_type`` over a schedule of
    ``total_steps``: the kernel and the warm-up in steps resolved (``optimizer.implementation =
    'auto'`` and ``warmup_ratio`` count through them), the length from ``training.epochs`` too."""
    from titan_draft.components.lr_scheduler import resolve_warmup_steps
    from titan_draft.components.optimizer import resolve_implementation

    implementation = resolve_implementation(cfg.optimizer.implementation, device_type)
    warmup_steps = resolve_warmup_steps(cfg.lr_scheduler, total_steps, warn=False)
    o, s = cfg.optimizer, cfg.lr_scheduler
    return {
        "optimizer.name": o.name.lower(),  # the name is matched without case
        "optimizer.implementation": implementation,
        "optimizer.lr": o.lr,
        "optimizer.beta1": o.beta1,
        "optimizer.beta2": o.beta2,
        "optimizer.eps": o.eps,
        "optimizer.weight_decay": o.weight_decay,
        "lr_scheduler.warmup_steps": warmup_steps,
        "lr_scheduler.decay_type": s.decay_type,
        "lr_scheduler.min_lr_factor": s.min_lr_factor,
        "training.steps": total_steps,
    }


def write_optimizer_keys(path: str, keys: dict[str, Any]) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, OPTIMIZER_KEYS), "w") as f:
        json.dump(keys, f, indent=1)


def check_optimizer_keys(path: str, keys: dict[str, Any] | None, apply: bool) -> list[str] | None:
    """Compare the checkpoint ``path``'s optimizer and schedule settings with this job's ``keys``.
    Returns the lines that say what changes when this job's values are to replace the restored
    ones (``apply`` and a difference), else None. Raises ResumeRefusedError naming the keys on a
    difference without ``apply``."""
    if keys is None:
        return None
    file = os.path.join(path, OPTIMIZER_KEYS)
    if not os.path.isfile(file):
        logger.warning("checkpoint: %s has no %s (an older version saved it): its optimizer and lr schedule "
                       "settings cannot be compared with this job's; %s", path, OPTIMIZER_KEYS,
                       f"{APPLY_FLAG}: this job's are applied" if apply else
                       f"the saved ones are restored (set {APPLY_FLAG} = true to apply this job's)")
        return [f"{k} (saved value unknown) -> {_short(v)}" for k, v in keys.items()] if apply else None
    with open(file) as f:
        saved = json.load(f)
    diff = [k for k in keys if saved.get(k) != keys[k]]
    if not diff:
        return None
    changes = [f"{k} {_short(saved.get(k))} -> {_short(keys[k])}" for k in diff]
    if not apply:
        raise ResumeRefusedError(
            f"checkpoint {path}: this job changes the optimizer or lr schedule it was saved with "
            f"({', '.join(changes)}); resume with the saved values, or set {APPLY_FLAG} = true to restore the "
            "weights, Adam moments, step and data position and train on with this job's values")
    return changes


def apply_optimizer_keys(optimizer, lr_scheduler, keys: dict[str, Any], changes: list[str]) -> None:
    """Put this job's settings (``keys``) into the just restored ``optimizer`` and ``lr_scheduler``
    and log each change (``changes``, from :func:`check_optimizer_keys`) on a line of its own."""
    from titan_draft.components.optimizer import apply_optimizer_settings

    before = lr_scheduler.get_last_lr()[0] if lr_scheduler is not None else None
    apply_optimizer_settings(optimizer, betas=(keys["optimizer.beta1"], keys["optimizer.beta2"]),
                             eps=keys["optimizer.eps"], weight_decay=keys["optimizer.weight_decay"],
                             implementation=keys["optimizer.implementation"])
    if lr_scheduler is not None:
        lr_scheduler.set_peak_lr(keys["optimizer.lr"])
    else:  # no schedule: the peak is the lr
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = keys["optimizer.lr"]
    for line in changes:
        logger.warning("checkpoint: %s: %s", APPLY_FLAG, line)
    if lr_scheduler is not None:
        logger.warning("checkpoint: %s: the next step's lr is %g (the saved schedule had %g)", APPLY_FLAG,
                       lr_scheduler.get_last_lr()[0], before)
