"""Job configuration: the JobConfig dataclasses and their loader (TOML + CLI overrides)."""

from titan_draft.config.job_config import JobConfig
from titan_draft.config.manager import (
    ConfigError,
    ConfigManager,
    dump_job_config,
    load_job_config,
    validate_job_config,
    write_job_config,
)

__all__ = [
    "ConfigError",
    "ConfigManager",
    "JobConfig",
    "dump_job_config",
    "load_job_config",
    "validate_job_config",
    "write_job_config",
]
