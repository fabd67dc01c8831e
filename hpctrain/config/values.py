"""Values in and out of TOML: the configuration's error types, each key's value checked
against the type of its default (:func:`_coerce`; ``data.sources`` as :class:`Source`
tables), ``--set`` literals, and the resolved config written back as TOML. Plain data."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration that cannot run; the message says why and how to fix it."""


class InputError(ConfigError):
    """What a valid configuration points at cannot be used (data file, run or checkpoint
    directory); raised deliberately before any collective, alike on every rank."""


@dataclass(frozen=True)
class Source:
    """One corpus of a blend (``data.sources``): a prepared file and its weight."""

    path: str
    weight: float


def sources(where: str, value: Any) -> tuple[Source, ...]:
    """``data.sources``: an array of ``{path = "...", weight = ...}`` tables."""
    form = f'{where} must be an array of tables like [{{path = "a.h5", weight = 0.7}}, ...]'
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{form}, got {value!r}")
    out = []
    for i, item in enumerate(value):
        if isinstance(item, Source):
            item = dataclasses.asdict(item)
        if not isinstance(item, dict) or set(item) != {"path", "weight"}:
            raise ConfigError(f"{form}; entry {i} is {item!r}")
        out.append(Source(_coerce(where, f"[{i}].path", item["path"], ""),
                          _coerce(where, f"[{i}].weight", item["weight"], 0.0)))
    return tuple(out)


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    """Check ``value`` against the type of ``default``; ints are accepted for floats."""
    where = f"{section}.{key}" if not key.startswith("[") else f"{section}{key}"
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            if not -2**63 <= value < 2**63:
                raise ConfigError(f"{where} must be a 64-bit integer, got {value!r}")
            return value
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 2**1023 else math.inf  # huge TOML ints
            if not math.isfinite(number):
                raise ConfigError(f"{where} must be a finite number, got {value!r}")
            return number
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if isinstance(default, str):
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # a size or a name that a shell unquoted: --set k="4" is k=4
        raise ConfigError(f"{where} must be a string, got {value!r}")
    if isinstance(default, tuple):
        return sources(where, value)
    if isinstance(default, dict):
        if isinstance(value, dict):
            return {str(k): str(v) for k, v in value.items()}
        raise ConfigError(f"{where} must be a table, got {value!r}")
    return value


def toml_key(name: str) -> str:
    """A field's key in TOML and ``--set``: a Python keyword is spelled with a trailing
    underscore in the dataclass (``async_``) and without it in the file (``async``)."""
    return name[:-1] if name.endswith("_") else name


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` -> (section, key, value); the value is read as a TOML literal
    (``3``, ``1e-3``, ``true``, ``"x"``) and falls back to a bare string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    lhs, rhs = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()
    return section, key, value


def dumps_toml(cfg) -> str:
    """The resolved config as TOML (written to every run directory and checkpoint)."""

    def lit(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(lit(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {lit(x)}" for k, x in v.items()) + "}"
        return repr(v)

    out = []
    for name, body in dataclasses.asdict(cfg).items():
        out.append(f"[{name}]")
        out += [f"{toml_key(k)} = {lit(v)}" for k, v in body.items()]
        out.append("")
    return "\n".join(out)
