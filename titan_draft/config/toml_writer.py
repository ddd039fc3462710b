"""A minimal TOML writer for the types a JobConfig holds; its output loads back unchanged."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from titan_draft.components.disk_full import write_atomic
from titan_draft.config.job_config import JobConfig
from titan_draft.config.validate import ConfigError


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_str(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.fullmatch(k) else _toml_str(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        text = repr(v)  # shortest repr round-trips exactly
        return text if any(c in text for c in ".en") else text + ".0"
    if isinstance(v, str):
        return _toml_str(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise ConfigError(f"cannot write {v!r} ({type(v).__name__}) as TOML")


def dump_job_config(cfg: JobConfig) -> str:
    """The config as TOML text; loading it back with --job.config_file gives an equal config."""
    lines = ["# Resolved job config (titan_draft). Reload with --job.config_file <this file>."]
    for section in dataclasses.fields(cfg):
        values = dataclasses.asdict(getattr(cfg, section.name))
        tables = {k: v for k, v in values.items() if isinstance(v, dict)}
        lines += ["", f"[{section.name}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if k not in tables]
        # sub-tables must follow every plain key of the section, or TOML would put them inside
        for name, table in tables.items():
            lines += ["", f"[{section.name}.{name}]"]
            lines += [f"{_toml_key(str(k))} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def write_job_config(cfg: JobConfig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(str(path), dump_job_config(cfg))  # a full disk must not truncate the previous run's file
    return path
