"""Turn argv into a JobConfig: dataclass defaults < TOML file < ``--section.key value`` overrides.

The semantic checks live in ``validate.py``, the TOML writer of the resolved config in
``toml_writer.py``.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import logging
import sys
import typing
from typing import Any, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from titan_draft.config.job_config import JobConfig
from titan_draft.config.sources import CLI_SOURCE, record_source
from titan_draft.config.toml_writer import _toml_value
from titan_draft.config.validate import ConfigError, validate_job_config

logger = logging.getLogger(__name__)

_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True,
               "false": False, "0": False, "no": False, "off": False}


# --------------------------------------------------------------------------------------------
# Schema: what sections and keys exist, their kinds and docstrings.


def _kind_of(tp: Any) -> str:
    """Reduce a field annotation to one of the kinds the loader knows how to convert."""
    origin = typing.get_origin(tp)
    if origin is list:
        (elem,) = typing.get_args(tp) or (str,)
        if elem not in (int, float, str):
            raise TypeError(f"unsupported list element type {elem!r}")
        return f"list[{elem.__name__}]"
    if origin is dict:
        return "dict"
    if tp in (bool, int, float, str):
        return tp.__name__
    raise TypeError(f"unsupported config field type {tp!r}")


@functools.lru_cache(maxsize=None)
def _module_field_docs(module_name: str) -> dict[str, dict[str, str]]:
    """{class name: {field: docstring}} from a module's source: the string literal statement right
    after an annotated assignment (the dataclass convention; Python itself drops these strings)."""
    source = inspect.getsource(sys.modules[module_name])
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for stmt, nxt in zip(node.body, node.body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                fields[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


@dataclasses.dataclass(frozen=True)
class _Field:
    section: str
    name: str
    kind: str
    default: Any
    doc: str

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"


def _schema(config_cls: type) -> dict[str, dict[str, _Field]]:
    schema: dict[str, dict[str, _Field]] = {}
    root_hints = typing.get_type_hints(config_cls)
    for section in dataclasses.fields(config_cls):
        section_cls = root_hints[section.name]
        hints = typing.get_type_hints(section_cls)
        docs = _module_field_docs(section_cls.__module__).get(section_cls.__name__, {})
        defaults = section_cls()
        schema[section.name] = {
            f.name: _Field(section.name, f.name, _kind_of(hints[f.name]),
                           getattr(defaults, f.name), docs.get(f.name, ""))
            for f in dataclasses.fields(section_cls)
        }
    return schema


def _suggest(name: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _norm(part: str) -> str:
    # --training.local-batch-size and --training.local_batch_size are the same key
    return part.strip().replace("-", "_")


# --------------------------------------------------------------------------------------------
# Value conversion.


def _parse_literal(raw: str) -> Any:
    """A CLI value for a free-form dict entry: a TOML literal (int, float, bool, list, inline
    table, quoted string) when it parses as exactly one, else the raw string."""
    try:
        parsed = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        return raw
    return parsed["v"] if len(parsed) == 1 else raw


def _convert_str(kind: str, raw: str) -> Any:
    """A CLI string to the field's kind; raises ValueError with the reason."""
    if kind == "str":
        return raw
    if kind == "bool":
        if raw.strip().lower() not in _BOOL_WORDS:
            raise ValueError("expected true or false")
        return _BOOL_WORDS[raw.strip().lower()]
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind.startswith("list["):
        elem = kind[5:-1]
        text = raw.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]
        items = [item.strip().strip("'\"") if elem == "str" else item.strip()
                 for item in text.split(",")]
        return [_convert_str(elem, item) for item in items if item != ""]
    raise ValueError(f"cannot set a {kind} from a string")


def _check_toml(kind: str, value: Any) -> Any:
    """A TOML value must already have the field's kind (ints widen to float)."""
    def ok(k: str, v: Any) -> bool:
        if k == "bool":
            return isinstance(v, bool)
        if k == "int":
            return isinstance(v, int) and not isinstance(v, bool)
        if k == "float":
            return isinstance(v, (int, float)) and not isinstance(v, bool)
        if k == "str":
            return isinstance(v, str)
        if k == "dict":
            return isinstance(v, dict)
        return isinstance(v, list) and all(ok(k[5:-1], x) for x in v)

    if not ok(kind, value):
        raise ValueError(f"expected {kind}, got {type(value).__name__}")
    if kind == "float":
        return float(value)
    if kind == "list[float]":
        return [float(x) for x in value]
    return dict(value) if kind == "dict" else value


# --------------------------------------------------------------------------------------------
# Loading.


@dataclasses.dataclass
class _Override:
    field: _Field
    raw: str | None  # None: a bare flag
    negate: bool = False
    subkey: str | None = None  # model.args.<subkey>


class ConfigManager:
    """Builds a JobConfig from argv. ``parse_args`` only parses; ``validate_job_config`` checks."""

    def __init__(self, config_cls: type = JobConfig):
        self.config_cls = config_cls
        self.schema = _schema(config_cls)

    def parse_args(self, argv: Sequence[str] | None = None) -> JobConfig:
        argv = list(sys.argv[1:] if argv is None else argv)
        if "-h" in argv or "--help" in argv:
            print(self.help_text())
            sys.exit(0)
        overrides = self._parse_cli(argv)
        cfg = self.config_cls()
        config_files = [o.raw for o in overrides if o.field.key == "job.config_file"]
        if config_files and config_files[-1]:
            path = config_files[-1]
            self._apply_toml(cfg, self._read_toml(path), source=path)
        for override in overrides:
            self._apply_override(cfg, override)
        return cfg

    # -- TOML --------------------------------------------------------------------------------

    @staticmethod
    def _read_toml(path: str) -> dict[str, Any]:
        try:
            with open(path, "rb") as f:
                return tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"job.config_file: no such file {path!r} (from {CLI_SOURCE})") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None

    def _apply_toml(self, cfg: JobConfig, data: dict[str, Any], source: str) -> None:
        for raw_section, table in data.items():
            section = _norm(raw_section)
            if not isinstance(table, dict):
                homes = [f.key for s in self.schema.values() for f in s.values() if f.name == section]
                hint = f"; did you mean {' or '.join(homes)}?" if homes else ""
                raise ConfigError(f"top-level key '{raw_section}' must sit inside a [section] "
                                  f"table (from {source}){hint}")
            if section not in self.schema:
                raise ConfigError(f"unknown section [{raw_section}] (from {source})"
                                  f"{_suggest(section, list(self.schema))}")
            for raw_key, value in table.items():
                fld = self._lookup(section, _norm(raw_key), source)
                try:
                    value = _check_toml(fld.kind, value)
                except ValueError as e:
                    raise ConfigError(f"{fld.key}: bad value {value!r}: {e} (from {source})") from None
                if fld.kind == "dict":
                    value = {**getattr(getattr(cfg, section), fld.name), **value}
                setattr(getattr(cfg, section), fld.name, value)
                record_source(cfg, fld.key, source)

    # -- CLI ---------------------------------------------------------------------------------

    def _lookup(self, section: str, name: str, source: str) -> _Field:
        if section not in self.schema:
            raise ConfigError(f"unknown section '{section}' (from {source})"
                              f"{_suggest(section, list(self.schema))}")
        fields = self.schema[section]
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=3, cutoff=0.6)
            if not close:  # maybe the right key in the wrong section
                close = [f.key for s in self.schema.values() for f in s.values() if f.name == name]
            else:
                close = [f"{section}.{n}" for n in close]
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(f"unknown key '{section}.{name}' (from {source}){hint}")
        return fields[name]

    def _parse_cli(self, argv: list[str]) -> list[_Override]:
        overrides: list[_Override] = []
        i = 0
        while i < len(argv):
            token = argv[i]
            i += 1
            if not token.startswith("--") or len(token) == 2:
                raise ConfigError(f"unexpected argument {token!r} (from {CLI_SOURCE}); "
                                  "overrides look like --section.key value")
            body, eq, raw = token[2:].partition("=")
            parts = [_norm(p) for p in body.split(".")]
            negate = False
            if parts[0] not in self.schema and parts[0].startswith("no_") and parts[0][3:] in self.schema:
                negate, parts[0] = True, parts[0][3:]
            if len(parts) < 2:
                raise ConfigError(f"unexpected argument {token!r} (from {CLI_SOURCE}); "
                                  "overrides look like --section.key value")
            fld = self._lookup(parts[0], parts[1], CLI_SOURCE)
            subkey = None
            if fld.kind == "dict" and len(parts) == 3:
                subkey = parts[2]
            elif len(parts) != 2:
                raise ConfigError(f"unknown key '{body}' (from {CLI_SOURCE}): "
                                  f"{fld.key} has no sub-keys")
            if negate and (fld.kind != "bool" or eq):
                raise ConfigError(f"--no-{fld.key} (from {CLI_SOURCE}): only a bool key can be "
                                  "negated, and it takes no value")
            value: str | None = raw if eq else None
            if value is None and not negate:
                nxt = argv[i] if i < len(argv) else None
                if fld.kind == "bool":
                    if nxt is not None and nxt.strip().lower() in _BOOL_WORDS:
                        value, i = nxt, i + 1
                elif nxt is not None and not nxt.startswith("--"):
                    value, i = nxt, i + 1
                elif subkey is None:
                    raise ConfigError(f"{fld.key}: missing value (from {CLI_SOURCE})")
            overrides.append(_Override(fld, value, negate, subkey))
        return overrides

    def _apply_override(self, cfg: JobConfig, o: _Override) -> None:
        fld = o.field
        section = getattr(cfg, fld.section)
        record_source(cfg, fld.key, CLI_SOURCE)
        if fld.kind == "bool" and o.raw is None:
            setattr(section, fld.name, not o.negate)
            return
        if fld.kind == "dict":
            current = dict(getattr(section, fld.name))
            if o.subkey is not None:
                current[o.subkey] = True if o.raw is None else _parse_literal(o.raw)
            else:
                table = _parse_literal(o.raw)
                if not isinstance(table, dict):
                    raise ConfigError(f"{fld.key}: bad value {o.raw!r}: expected an inline table "
                                      f"like '{{name = 1}}' or --{fld.key}.<name> VALUE "
                                      f"(from {CLI_SOURCE})")
                current.update(table)
            setattr(section, fld.name, current)
            return
        try:
            value = _convert_str(fld.kind, o.raw)
        except ValueError as e:
            raise ConfigError(f"{fld.key}: bad {fld.kind} value {o.raw!r}: {e} "
                              f"(from {CLI_SOURCE})") from None
        setattr(section, fld.name, value)

    # -- help --------------------------------------------------------------------------------

    def help_text(self) -> str:
        lines = [
            "usage: python -m titan_draft.train [--job.config_file FILE] [--section.key VALUE ...]",
            "",
            "Precedence: command line > TOML file > defaults. Keys accept '-' or '_'; bools are",
            "bare flags (--compile.enable), take a value (--compile.enable false) or a --no- prefix",
            "(--no-compile.enable); lists are comma-separated (--target.capture_layers 1,9,17);",
            "dict entries take TOML literals (--model.args.num_anchors 256).",
        ]
        for section, fields in self.schema.items():
            lines += ["", f"[{section}]"]
            for f in fields.values():
                lines.append(f"  --{f.key} {f.kind.upper()}  (default: {_toml_value(f.default)})")
                lines += [f"      {line}" for line in f.doc.splitlines()]
        return "\n".join(lines)


def load_job_config(argv: Sequence[str] | None = None, *, validate: bool = True,
                    log: logging.Logger | None = None) -> JobConfig:
    """Parse argv (defaults < TOML < CLI) and, unless told not to, validate the result."""
    cfg = ConfigManager().parse_args(argv)
    if validate:
        validate_job_config(cfg, log)
    return cfg
