"""Distributed checkpoints (torch.distributed.checkpoint) of the whole training state.

Layout: ``{dump_folder}/{checkpoint.folder}/step-{N}/`` holding DCP's per-rank ``.distcp`` files
and its ``.metadata``. DCP writes ``.metadata`` last (an atomic rename, after every rank's data is
on disk), so a folder is a *complete* checkpoint iff ``.metadata`` exists; an interrupted save
leaves a folder without it, which ``load`` skips with a warning. After DCP, rank 0 writes
``integrity.json`` (every file's size and SHA-256, see checkpoint_integrity.py); a resume takes the
newest checkpoint whose files still match it and names the ones it passed over and why.

What is saved (top-level keys of the DCP state dict):

- ``model``: ``get_model_state_dict``, whose FQNs are clean (``_orig_mod.`` and
  ``_checkpoint_wrapped_module.`` stripped) and which excludes non-persistent buffers. FSDP2
  params stay DTensors, so every rank writes only its shard and a resume may reshard.
- ``optimizer``: ``get_optimizer_state_dict`` flattened to ``optimizer.state.<fqn>.exp_avg``-style
  keys, i.e. keyed by parameter FQN rather than by position, so it survives reordering.
- ``lr_scheduler``: the ``LambdaLR`` state (step count and lrs).
- ``dataloader.dp_rank_{r}``: each DP rank's dataloader state (pickled), under its own key because
  DCP dedups identical keys across ranks and would keep only one. ``dataloader.dp_world`` records
  the DP size. A resume on another DP size reads every saved rank's entry and the dataloader moves
  the position to the new ranks where that is exact, or refuses in one line (data/reshard.py,
  docs/reliability.md).
- ``train_state``: step and tokens seen.

It runs in one process without a process group (DCP's "no_dist" mode) and under gloo/nccl.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from titan_draft.checkpoint.errors import CheckpointSaveError, describe_save_failure, remove_partial
from titan_draft.checkpoint.choice import METADATA, global_rank, is_complete, list_steps, resolve_resume_step
from titan_draft.checkpoint.integrity import RECORD, write_integrity_record
from titan_draft.checkpoint.states import DataLoaderWrapper, ModelWrapper, OptimizerWrapper, TrainState
from titan_draft.checkpoint.resume_guard import (
    ResumeRefusedError,
    apply_optimizer_keys,
    check_data_keys,
    check_optimizer_keys,
    write_data_keys,
    write_optimizer_keys,
)
from titan_draft.config.job_config import Checkpoint as CheckpointConfig

logger = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "TrainState", "is_complete", "list_steps", "resolve_resume_step"]

MODEL = "model"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
DATALOADER = "dataloader"
TRAIN_STATE = "train_state"



@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; one process is a supported mode here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _describe(e: BaseException) -> str:
    """One line per failing rank instead of DCP's multi-rank traceback dump."""
    if isinstance(e, CheckpointException):
        return "; ".join(
            f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in e.failures.items()
        )
    return f"{type(e).__name__}: {e}"


def _first_refusal(line: str | None) -> str | None:
    """The refusal of the lowest rank that has one, on every rank."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return line
    lines: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    return next((x for x in lines if x is not None), None)


_UNRESOLVED = object()


class CheckpointManager:
    """Saves and restores the training state with DCP.

    ``model`` and ``optimizer`` may be FSDP2-sharded; ``dataloader`` is anything with
    ``state_dict()``/``load_state_dict()``; ``lr_scheduler``, ``dataloader`` and ``train_state``
    may be None (then they are neither saved nor loaded).
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        dump_folder: str,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        lr_scheduler: Stateful | None,
        dataloader: Any | None,
        train_state: Stateful | None,
        dp_rank: int,
        dp_world: int,
        data_keys: dict[str, Any] | None = None,
        optimizer_keys: dict[str, Any] | None = None,
        resume_step: Any = _UNRESOLVED,
    ) -> None:
        if cfg.keep_latest_k < 0:
            raise ValueError(f"checkpoint.keep_latest_k must be >= 0, got {cfg.keep_latest_k}")
        self.cfg = cfg
        self.folder = os.path.join(dump_folder, cfg.folder)
        self._dump_folder = dump_folder
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.data_keys = data_keys  # what the saved data position means (resume_guard.py)
        self.optimizer_keys = optimizer_keys  # the optimizer and schedule settings (resume_guard.py)
        # the step to resume from, when the caller resolved it already (resolve_resume_step)
        self._resume_step = resume_step
        self._prepared = False
        self._fresh_data = False
        self._new_settings: list[str] | None = None
        self.states: dict[str, Stateful] = {MODEL: ModelWrapper(model)}
        if optimizer is not None:
            self.states[OPTIMIZER] = OptimizerWrapper(model, optimizer)
        if lr_scheduler is not None:
            self.states[LR_SCHEDULER] = lr_scheduler
        if dataloader is not None:
            self.states[DATALOADER] = DataLoaderWrapper(dataloader, dp_rank, dp_world)
        if train_state is not None:
            self.states[TRAIN_STATE] = train_state
        self._last_saved_step = -1

    # ---- layout -------------------------------------------------------------------------------

    def step_folder(self, step: int) -> str:
        return os.path.join(self.folder, f"step-{step}")

    def list_steps(self) -> tuple[list[int], list[int]]:
        """(complete steps, incomplete steps) found under the checkpoint folder, ascending."""
        return list_steps(self.folder)

    def describe_last(self) -> str:
        """A phrase naming the newest complete checkpoint on disk (for lines that say what is kept)."""
        complete, _ = self.list_steps()
        if not complete:
            return "no checkpoint was saved" if self.cfg.enable else "checkpointing is off"
        return f"the last good checkpoint is {self.step_folder(complete[-1])}"

    # ---- save ---------------------------------------------------------------------------------

    def is_saved(self, step: int) -> bool:
        """Whether this run saved (or loaded) ``step`` last."""
        return self.cfg.enable and step == self._last_saved_step

    def should_save(self, step: int, *, force: bool = False) -> bool:
        if not self.cfg.enable or step == self._last_saved_step:
            return False
        return force or (self.cfg.interval > 0 and step % self.cfg.interval == 0)

    def save(self, step: int, *, force: bool = False) -> bool:
        """Save at ``step`` if it is a multiple of ``checkpoint.interval`` or ``force`` (last step).

        Collective: every rank calls it. Returns whether a checkpoint was written.
        """
        if not self.should_save(step, force=force):
            return False
        path = self.step_folder(step)
        rank = global_rank()
        if rank == 0 and is_complete(path):
            # Overwriting (e.g. after resuming from an earlier load_step): drop the old marker first
            # so that a crash mid-write leaves the folder incomplete instead of silently mixed.
            logger.warning("checkpoint: overwriting existing %s", path)
            os.remove(os.path.join(path, METADATA))
            if os.path.exists(os.path.join(path, RECORD)):
                os.remove(os.path.join(path, RECORD))
        t0 = time.perf_counter()
        try:
            if rank == 0 and self.data_keys is not None:
                write_data_keys(path, self.data_keys)  # before DCP: a complete folder has it
            if rank == 0 and self.optimizer_keys is not None:
                write_optimizer_keys(path, self.optimizer_keys)
            with _quiet_single_process():
                dcp.save(self.states, checkpoint_id=path)
            if rank == 0:
                write_integrity_record(path)
        except (Exception, CheckpointException) as e:  # disk full, permissions: one line, no debris
            brief = _describe(e).splitlines()[0][:300]
            # measured before the partial folder goes: afterwards the disk looks emptier than it was
            line = describe_save_failure(e, brief, path, self.folder, self.describe_last())
            if rank == 0:
                remove_partial(path)
            raise CheckpointSaveError(line) from e
        self._last_saved_step = step
        logger.info("checkpoint: saved %s in %.2f s", path, time.perf_counter() - t0)
        # dcp.save returns on the coordinator (rank 0) only after .metadata is written, i.e. after
        # every rank's data is on disk, so rank 0 may purge now.
        if rank == 0:
            self._purge(keep=step)
        return True

    def _purge(self, keep: int) -> None:
        """Remove the oldest complete checkpoints beyond ``keep_latest_k`` (never ``keep``)."""
        k = self.cfg.keep_latest_k
        if k <= 0:
            return
        complete, _ = self.list_steps()
        for step in complete[: max(0, len(complete) - k)]:
            if step == keep:
                continue
            path = self.step_folder(step)
            logger.info("checkpoint: removing old %s (keep_latest_k=%d)", path, k)
            try:
                shutil.rmtree(path)
            except OSError as e:  # disk hygiene must not stop training
                logger.warning("checkpoint: could not remove %s: %s", path, e)

    # ---- load ---------------------------------------------------------------------------------

    def remove_incomplete(self) -> list[str]:
        """Remove the step folders that an interrupted save left (no ``.metadata``: never loaded,
        see :func:`is_complete`); rank 0, at start. No other run can be writing them: the run lock
        of the dump folder keeps out a second trainer, so a checkpoint folder outside the dump
        folder (an absolute ``checkpoint.folder``) is left alone. Returns the removed paths."""
        if not self.cfg.enable or global_rank() != 0:
            return []
        folder, dump = os.path.realpath(self.folder), os.path.realpath(self._dump_folder)
        paths = [self.step_folder(s) for s in self.list_steps()[1]]
        if not paths or os.path.commonpath([folder, dump]) != dump:
            return []
        removed = []
        for path in paths:
            try:
                shutil.rmtree(path)
                removed.append(path)
            except OSError as e:  # disk hygiene must not stop training
                logger.warning("checkpoint: could not remove the incomplete %s: %s", path, e)
        if removed:
            logger.info("checkpoint: removed incomplete checkpoint folder(s) left by an interrupted save: %s",
                        ", ".join(removed))
        return removed

    def _saved_dp_world(self, path: str) -> int:
        """The DP size the checkpoint's dataloader state was saved with."""
        try:
            metadata = FileSystemReader(path).read_metadata()
        except Exception as e:
            raise RuntimeError(f"checkpoint {path}: cannot read .metadata ({_describe(e)})") from e
        key = f"{DATALOADER}.dp_world"
        if key not in metadata.state_dict_metadata:
            raise RuntimeError(f"checkpoint {path} holds no dataloader state ({key} missing)")
        probe: dict[str, Any] = {DATALOADER: {"dp_world": None}}
        try:
            with _quiet_single_process():
                dcp.load(probe, checkpoint_id=path)
        except (Exception, CheckpointException) as e:
            raise RuntimeError(f"checkpoint {path}: cannot read {key} ({_describe(e)})") from e
        return int(probe[DATALOADER]["dp_world"])

    def _load_data_position(self, path: str, wrapper: DataLoaderWrapper) -> None:
        """Load the dataloader state first and on its own: a position that cannot be resumed on
        this DP size is refused before the (large) model and optimizer are read."""
        saved = self._saved_dp_world(path)
        if saved != self.dp_world:
            logger.info("checkpoint: %s was saved with %d data-parallel ranks, this run has %d: DCP reshards the "
                        "model and optimizer, the data position is moved where that is exact", path, saved,
                        self.dp_world)
        wrapper.saved_world = saved
        try:
            with _quiet_single_process():
                dcp.load({DATALOADER: wrapper}, checkpoint_id=path)
        except (Exception, CheckpointException) as e:
            wrapper.saved_world = None
            raise RuntimeError(f"checkpoint {path}: cannot read the dataloader state ({_describe(e)})") from e
        try:
            wrapper.apply()
            refusal = None
        except ValueError as e:
            refusal = e
        # One decision for all ranks: on a DP change some new ranks may continue exactly and others
        # not, and a rank that went on to the model load alone would wait there forever.
        first = _first_refusal(None if refusal is None else str(refusal))
        if first is not None:  # the lowest refusing rank's line everywhere: one line in the log
            raise ResumeRefusedError(first) from refusal

    def prepare_resume(self, step: int = -1) -> int | None:
        """Choose the checkpoint to resume from and decide whether this job may resume it, before
        the model and optimizer are read and before the trainer writes anything: the data keys and
        the optimizer and schedule settings are compared (resume_guard.py) and the data position
        is loaded (small; it may refuse another DP size). Collective. Returns the chosen step
        (None: nothing to resume); raises ResumeRefusedError naming every key a refusal is about."""
        if self._prepared and step < 0:
            return self._resume_step
        if step >= 0 or self._resume_step is _UNRESOLVED:
            self._resume_step = resolve_resume_step(self.cfg, self._dump_folder, step)
        self._prepared, chosen = True, self._resume_step
        self._fresh_data, self._new_settings = False, None
        if chosen is None:
            return None
        path = self.step_folder(chosen)
        refusals = []
        try:
            self._fresh_data = check_data_keys(path, self.data_keys, self.cfg.reset_data_position)
        except ResumeRefusedError as e:
            refusals.append(str(e))
        try:
            self._new_settings = check_optimizer_keys(path, self.optimizer_keys,
                                                      self.cfg.apply_new_optimizer_settings)
        except ResumeRefusedError as e:
            refusals.append(str(e))
        if refusals:  # both at once: a user fixing one should not meet the other on the next start
            self._prepared = False
            raise ResumeRefusedError("; and ".join(refusals))
        if DATALOADER in self.states and not self._fresh_data:
            try:
                self._load_data_position(path, self.states[DATALOADER])
            except BaseException:
                self._prepared = False
                raise
        return chosen

    def load(self, step: int = -1) -> int:
        """Restore the state from ``step`` (or ``checkpoint.load_step``, or the newest complete);
        :meth:`prepare_resume` first, unless it ran already. With
        ``checkpoint.apply_new_optimizer_settings`` and other settings than the saved ones, this
        job's replace them in the restored optimizer and schedule.

        Collective: every rank calls it. Returns the loaded step, 0 when there is nothing to load.
        Raises, naming the folder, when the checkpoint is corrupt or does not match this run;
        nothing on disk is touched either way.
        """
        if not self.cfg.enable:
            return 0
        chosen = self.prepare_resume(step)
        if chosen is None:
            logger.info("checkpoint: nothing to resume from in %s", self.folder)
            return 0
        path = self.step_folder(chosen)
        t0 = time.perf_counter()
        states = {k: v for k, v in self.states.items() if k != DATALOADER}
        try:
            with _quiet_single_process():
                dcp.load(states, checkpoint_id=path)
        except (Exception, CheckpointException) as e:
            # DCP's CheckpointException is a BaseException; wrap it so callers see the folder.
            raise RuntimeError(
                f"checkpoint {path} could not be loaded (corrupt, or saved by a different "
                f"model/optimizer configuration): {_describe(e)}"
            ) from e
        if self._new_settings is not None and OPTIMIZER in self.states:
            apply_optimizer_keys(self.states[OPTIMIZER].optimizer, self.states.get(LR_SCHEDULER),
                                 self.optimizer_keys, self._new_settings)
        self._last_saved_step = chosen
        self._prepared, self._resume_step = False, _UNRESOLVED  # a later load chooses afresh
        logger.info("checkpoint: loaded %s in %.2f s", path, time.perf_counter() - t0)
        return chosen
