"""Where each value of a parsed JobConfig came from (a key's default, a job file, the command line),
so that a message about a bad value names the place the user set it.

Kept as an attribute of the JobConfig instance rather than a dataclass field: a field would be
written into job_config.toml and take part in comparisons of configs.
"""

from __future__ import annotations

from typing import Any

_ATTR = "_value_sources"
CLI_SOURCE = "command line"


def record_source(cfg: Any, key: str, source: str) -> None:
    """``key`` (``section.name``) of ``cfg`` was last set by ``source`` (a job file path or
    :data:`CLI_SOURCE`)."""
    sources = getattr(cfg, _ATTR, None)
    if sources is None:
        sources = {}
        object.__setattr__(cfg, _ATTR, sources)
    sources[key] = source


def value_source(cfg: Any, key: str) -> str | None:
    """The job file path or :data:`CLI_SOURCE` that set ``key``; None for its default."""
    return getattr(cfg, _ATTR, {}).get(key)


def describe_source(cfg: Any, key: str) -> str:
    """`` (from the command line)``, `` (job file X)``, or '' for a default value with no job file;
    a default inside a job's run is said as the job file's (the file left the key unset)."""
    source = value_source(cfg, key)
    if source == CLI_SOURCE:
        return f" (from the {CLI_SOURCE})"
    if source is not None:
        return f" (job file {source})"
    config_file = getattr(getattr(cfg, "job", None), "config_file", "")
    return f" (job file {config_file}, which leaves it unset)" if config_file else ""
