"""The trainer's command line: every failure a user can act on is one line, with an exit status.

- 2: the job itself is wrong (a key, a value, a path, the draft, the data, the ranks launched, a
  feature cache of another job): nothing was trained.
- 1: the run could not go on (another trainer holds the dump folder, a non-finite step, a data
  row that cannot be prepared, a save that failed, a full disk wherever it is met); the line says
  what is kept.
- 0: done, or stopped by SIGTERM/SIGINT after saving (the last line says where to resume), or
  during start-up, before anything was trained (the last line says so).

Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from typing import Callable

from titan_draft.checkpoint.errors import CheckpointSaveError
from titan_draft.components.disk_full import (DiskFullError, disk_full_line, error_path, is_disk_full,
                                              quiet_writer_thread_disk_full)
from titan_draft.components.nonfinite import NonFiniteError
from titan_draft.features.offline import FeatureCacheMismatchError, check_feature_cache
from titan_draft.components.preflight import check_job_before_loading
from titan_draft.checkpoint.resume_guard import ResumeRefusedError
from titan_draft.components.run_lock import RunLockError
from titan_draft.components.signals import StoppedDuringStartup, maybe_handle_stop_signals
from titan_draft.features.target import check_target_config
from titan_draft.config import ConfigManager, validate_job_config, validate_launch
from titan_draft.data.worker_errors import DataWorkerError
from titan_draft.distributed.utils import destroy_distributed
from titan_draft.logger import init_logger, logger

RUN_ERRORS = (RunLockError, NonFiniteError, DataWorkerError, CheckpointSaveError, ResumeRefusedError, DiskFullError)


def _fail(e: BaseException, status: int):
    print(f"titan_draft: error: {e}", file=sys.stderr)
    raise SystemExit(status) from None


def run_cli(build_trainer: Callable, argv: list[str] | None = None) -> None:
    """Parse and check the job, then build the trainer with ``build_trainer(cfg)`` and train."""
    init_logger()
    quiet_writer_thread_disk_full()
    try:
        with maybe_handle_stop_signals(at_once=True):  # until training begins, a stop has nothing to save
            cfg, trainer = _start(build_trainer, argv)
    except StoppedDuringStartup as e:
        destroy_distributed()
        print(f"titan_draft: {e}", file=sys.stderr)
        raise SystemExit(0) from None
    try:
        try:
            trainer.train()
            if trainer.stop_line:  # a stop signal: exit 0, the last line says where to resume
                print(f"titan_draft: {trainer.stop_line}", file=sys.stderr)
        except RUN_ERRORS as e:
            _fail(e, 1)
        finally:
            try:
                trainer.close()
            finally:
                destroy_distributed()
    except Exception as e:
        _fail_if_disk_full(e, cfg)
        raise


def _start(build_trainer: Callable, argv: list[str] | None):
    """The job, checked, and its trainer built: (cfg, trainer)."""
    try:
        cfg = ConfigManager().parse_args(sys.argv[1:] if argv is None else argv)
        # the first line as soon as the job is known: loading a target can take minutes
        logger.info(f"job {cfg.job.config_file or '(defaults)'} -> {cfg.job.dump_folder}: checking it, "
                    f"then loading the target {cfg.target.path or 'random:' + cfg.target.flavor}")
        validate_job_config(cfg, logger)
        validate_launch(cfg)  # the device and the number of ranks, before any process group
        check_target_config(cfg)
        check_job_before_loading(cfg)  # draft, source, capture layers, usable rows: before the target loads
        check_feature_cache(cfg)  # offline: the cache's manifest and shards exist and are whole
    except ValueError as e:
        _fail(e, 2)
    try:
        return cfg, build_trainer(cfg)
    except RUN_ERRORS as e:
        _fail(e, 1)
    except FeatureCacheMismatchError as e:  # the job is wrong for its cache: nothing was trained
        _fail(e, 2)
    except Exception as e:
        _fail_if_disk_full(e, cfg)
        raise


def _fail_if_disk_full(e: Exception, cfg) -> None:
    """A full disk met outside the save and the export (the run lock, run_info.json, the log,
    TensorBoard's event file) is one line too; checkpoints already written are untouched."""
    if is_disk_full(e):
        path = error_path(e) or cfg.job.dump_folder
        _fail(f"writing {path} failed: {disk_full_line(path)}; the checkpoints already saved are kept", 1)
