"""Job configuration: the JobConfig dataclasses and their loader (TOML + CLI overrides)."""

from titan_draft.config.job_config import JobConfig
from titan_draft.config.manager import ConfigManager, load_job_config
from titan_draft.config.toml_writer import dump_job_config, write_job_config
from titan_draft.config.validate import ConfigError, validate_job_config, validate_launch

__all__ = [
    "ConfigError",
    "ConfigManager",
    "JobConfig",
    "dump_job_config",
    "load_job_config",
    "validate_job_config",
    "validate_launch",
    "write_job_config",
]
