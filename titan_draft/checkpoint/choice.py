"""Which checkpoint a resume takes: ``checkpoint.load_step``, else the newest complete one whose
files still match their integrity record; and the one line when there is none to take.

A step folder is complete iff DCP finished it by writing ``.metadata`` (see manager.py)."""

from __future__ import annotations

import logging
import os
import re

import torch.distributed as dist

from titan_draft.checkpoint.integrity import RECORD, broadcast_choice, newest_verified, verify_checkpoint
from titan_draft.checkpoint.resume_guard import ResumeRefusedError
from titan_draft.config.job_config import Checkpoint as CheckpointConfig

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d+)$")
METADATA = ".metadata"


def global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_complete(path: str) -> bool:
    """A DCP checkpoint folder is complete iff DCP finished it by writing ``.metadata``."""
    return os.path.isfile(os.path.join(path, METADATA))


def list_steps(folder: str) -> tuple[list[int], list[int]]:
    """(complete steps, incomplete steps) found in the checkpoint ``folder``, ascending."""
    if not os.path.isdir(folder):
        return [], []
    complete, incomplete = [], []
    for name in os.listdir(folder):
        m = _STEP_DIR.match(name)
        if m is None or not os.path.isdir(os.path.join(folder, name)):
            continue
        (complete if is_complete(os.path.join(folder, name)) else incomplete).append(int(m.group(1)))
    return sorted(complete), sorted(incomplete)


def _steps_phrase(folder: str, steps: list[int]) -> str:
    if not steps:
        return f"{folder} holds no complete checkpoint"
    return f"the complete checkpoints in {folder} are " + ", ".join(f"step-{s}" for s in steps)


def resolve_resume_step(cfg: CheckpointConfig, dump_folder: str, step: int = -1) -> int | None:
    """The step to resume from: ``step``, else ``checkpoint.load_step``, else the newest complete
    checkpoint that verifies; None when there is none (or checkpointing is off). Collective (rank 0
    hashes, every rank gets its choice); cheap beside a load, so the trainer calls it before the
    target loads. Raises ResumeRefusedError (one line naming the folder and the steps there) for a
    requested step that is missing or damaged, and when every checkpoint fails verification."""
    if not cfg.enable:
        return None
    folder = os.path.join(dump_folder, cfg.folder)
    requested = step if step >= 0 else cfg.load_step
    complete, incomplete = list_steps(folder)
    step_folder = lambda s: os.path.join(folder, f"step-{s}")  # noqa: E731
    if requested >= 0:
        path = step_folder(requested)
        if not is_complete(path):
            state = "has no .metadata (an interrupted save)" if os.path.isdir(path) else "does not exist"
            raise ResumeRefusedError(
                f"checkpoint step {requested} requested (checkpoint.load_step) but {path} {state}; "
                f"{_steps_phrase(folder, complete)} (checkpoint.load_step -1 resumes from the newest)")
        why = broadcast_choice(verify_checkpoint(path) if global_rank() == 0 else None)
        if why is not None and os.path.isfile(os.path.join(path, RECORD)):
            others = [s for s in complete if s != requested]
            raise ResumeRefusedError(f"checkpoint step {requested} requested but {path} does not verify: {why}; "
                                     f"{_steps_phrase(folder, others).replace('complete', 'other complete', 1)}")
        newer = [s for s in complete if s > requested]
        if newer:
            logger.warning(
                "checkpoint: resuming from step %d while newer checkpoints exist (%s); saves at "
                "those steps will overwrite them and a later resume without load_step picks "
                "the newest",
                requested,
                ", ".join(f"step-{s}" for s in newer),
            )
        return requested
    if incomplete:
        logger.warning(
            "checkpoint: skipping incomplete checkpoint(s) without .metadata (interrupted "
            "save?): %s",
            ", ".join(step_folder(s) for s in incomplete),
        )
    chosen, skipped, verified = broadcast_choice(
        newest_verified(complete, step_folder) if global_rank() == 0 else None)
    if skipped:
        logger.warning("checkpoint: skipped %s; %s", ", ".join(skipped),
                       f"resuming from step-{chosen}" if chosen is not None else "no checkpoint left")
    if chosen is None and skipped:
        raise ResumeRefusedError(
            f"checkpoint: none of the {len(skipped)} checkpoint(s) in {folder} verifies "
            f"({'; '.join(skipped)}); refusing to start over on top of them: move them away to "
            "start afresh, or set checkpoint.load_step to one of them to see its error")
    if chosen is not None and not verified:
        logger.warning("checkpoint: %s has no %s: resuming from it unverified", step_folder(chosen), RECORD)
    return chosen
