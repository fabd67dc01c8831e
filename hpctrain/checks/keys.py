"""The rules of single keys, declared beside the keys (``hpctrain.config.key``): enforced by
:func:`key_problems`, documented by :func:`markdown` (docs/config.md).

Regenerate the reference after changing a key::

    python -m hpctrain.checks.keys --markdown > docs/config.md
"""

from __future__ import annotations

import dataclasses
import sys

from ..config import LEGACY, Config, toml_key

REGENERATE = "python -m hpctrain.checks.keys --markdown > docs/config.md"


def _shown(x) -> str:
    return "2**63" if x == 2**63 else str(x)


def rule_problem(name: str, value, meta) -> str | None:
    """Why ``value`` breaks the rule ``meta`` (a field's metadata) of key ``name``; None if
    it does not."""
    choices, ge, gt, within = (meta.get(k) for k in ("choices", "ge", "gt", "within"))
    if choices and value not in choices:
        if all(isinstance(c, str) for c in choices):
            return f"{name}={value!r}; valid: {', '.join(c or repr(c) for c in choices)}"
        listed = ", ".join(map(str, choices[:-1]))
        return f"{name}={value!r} must be {listed} or {choices[-1]}"
    if ge is not None and not value >= ge:
        return f"{name}={value!r} must be >= {ge}"
    if gt is not None and not value > gt:
        return f"{name}={value!r} must be > {gt}"
    if within is not None and not within[0] <= value < within[1]:
        return f"{name}={value!r} must be in [{_shown(within[0])}, {_shown(within[1])})"
    return None


def key_problems(cfg: Config, sections: tuple[str, ...] | None = None) -> list[str]:
    """Every key of ``sections`` (default: all) whose value breaks its declared rule."""
    out = []
    for sec in dataclasses.fields(cfg):
        if sections is None or sec.name in sections:
            out += _section_problems(sec.name, getattr(cfg, sec.name))
    return out


_KNOWN: dict[str, tuple[str, ...]] = {}  # a section's repr -> its broken rules


def _section_problems(name: str, body) -> tuple[str, ...]:
    """The broken rules of one section. A search judges many configs whose sections repeat,
    so the answer is kept, keyed by the section's repr: the values as the messages show
    them (``0`` and ``0.0`` are equal but read differently)."""
    key = f"{name}:{body!r}"
    found = _KNOWN.get(key)
    if found is None:
        if len(_KNOWN) >= 4096:
            _KNOWN.clear()
        found = _KNOWN[key] = _problems_of(name, body)
    return found


def registered() -> dict[str, tuple[str, ...]]:
    """Keys whose allowed values are the names of a registry, which owns them (a new
    entry there is allowed here and listed in docs/config.md)."""
    from ..model.families import names
    from ..pipeline.schedules import REGISTRY

    return {"schedule.kind": tuple(REGISTRY), "model.family": ("", *names())}


def _rules(name: str, meta) -> dict:
    """A key's declared rule, with its registry's names as the choices where it has one."""
    names = registered().get(name)
    return {**meta, "choices": names} if names else meta


def _problems_of(name: str, body) -> tuple[str, ...]:
    return tuple(why for f in dataclasses.fields(body)
                 if (why := rule_problem(f"{name}.{toml_key(f.name)}", getattr(body, f.name),
                                         _rules(f"{name}.{toml_key(f.name)}", f.metadata)))
                 is not None)


def _allowed(meta) -> str:
    if meta.get("choices"):
        return ", ".join(f"`{c}`" if c != "" else '`""`' for c in meta["choices"])
    if meta.get("ge") is not None:
        return f">= {meta['ge']}"
    if meta.get("gt") is not None:
        return f"> {meta['gt']}"
    if meta.get("within") is not None:
        lo, hi = meta["within"]
        return f"in [{_shown(lo)}, {_shown(hi)})"
    return ""


def _literal(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return "{}" if value == {} else "[]" if value == () else repr(value)


INTRO = f"""# Configuration reference

<!-- Generated from hpctrain/config/; do not edit. Regenerate: {REGENERATE} -->

A run is described by a TOML preset (see `share/configs/`), one table per section below,
plus `--set section.key=value` overrides on the command line (repeatable; the value is read
as a TOML literal: `3`, `1e-3`, `true`, `"x"`, or else a bare string):

    hpctrain train share/configs/tiny.toml --run-dir runs/x --set train.steps=10

Keys left out take their default. Unknown sections and keys, wrong types and non-finite
numbers are refused when the config is read; the rules below (and those that span keys, such
as `dp*tp*pp` = the world size) are checked on every rank before any collective, and every
problem is reported at once (`hpctrain plan CONFIG --world-size N` checks a config without
MPI).
"""

LEGACY_NOTE = """
Keys that moved are still read under their old names (older checkpoints and presets), and
stored under the new ones:

| old key | new key |
|---|---|
"""


def markdown() -> str:
    """docs/config.md: every key of every section with its type, default, meaning and
    allowed values."""
    out = [INTRO]
    for sec in dataclasses.fields(Config):
        out.append(f"## [{sec.name}]\n")
        doc = sec.default_factory.__doc__ or ""  # type: ignore[misc]
        if sec.name == "experimental" and doc:
            out.append(f"{doc.strip()}\n")
        out += ["| key | type | default | meaning | allowed |", "|---|---|---|---|---|"]
        body = sec.default_factory()  # type: ignore[misc]
        for f in dataclasses.fields(body):
            cell = f.metadata.get("help", "").replace("|", "\\|")
            rules = _rules(f"{sec.name}.{toml_key(f.name)}", f.metadata)
            out.append(f"| `{toml_key(f.name)}` | {f.type} | `{_literal(getattr(body, f.name))}` "
                       f"| {cell} | {_allowed(rules)} |")
        out.append("")
    out.append(LEGACY_NOTE + "".join(f"| `{a}` | `{b}` |\n" for a, b in LEGACY.items()))
    return "\n".join(out)


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit(f"usage: {REGENERATE}")
    sys.stdout.write(markdown())
