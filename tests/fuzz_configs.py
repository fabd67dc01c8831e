"""Hypothesis strategies for configurations as a user gives them: a TOML file, ``--set``
strings and a world size, from plausible to absurd (wrong types, unknown keys and sections,
malformed overrides, non-finite and huge numbers), plus what the CLI must answer for them
(:func:`expected`) and the rule behind a message (:func:`template`).

Used by tests/unit/test_config_fuzz.py (``hpctrain plan``, in process, hundreds of
examples) and tests/e2e/test_config_fuzz_train.py (``hpctrain train``, a few, as processes).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from hypothesis import strategies as st

from hpctrain.config import Config, ConfigError, load, toml_key

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "share/configs/tiny.toml")
SECTIONS = {f.name: f.default_factory() for f in dataclasses.fields(Config)}
KEYS = [(s, toml_key(f.name), getattr(body, f.name)) for s, body in SECTIONS.items()
        for f in dataclasses.fields(body)]

# Strings some keys take, right and wrong (the rest draw from GARBAGE).
CHOICES = {
    "model.dtype": ["float32", "float64", "bfloat16", "float16", "float8", ""],
    "model.device": ["cpu", "cuda", "tpu"],
    "model.arch": ["gpt", "llama", "llama", "mamba"],
    "schedule.kind": ["gpipe", "1f1b", "interleaved", "zb-h1", "zigzag"],
    "schedule.boundaries": ["", "4", "2,4,6", "1,4,6", "6,2", "x", "0,8", "3,,6"],
    "experimental.placement": ["auto", "naive", "random"],
    "topology.dp_reduction": ["flat", "hierarchical", "tree"],
    "experimental.reduction": ["bucketed", "bucketed-nonblocking", "per-parameter", "ring"],
    "telemetry.on_skips": ["rollback", "stop", "ignore"],
    "data.path": ["", "/nonexistent/data.h5", "share"],
    "data.tokenizer": ["", "/nonexistent/tokenizer.json", "share"],
    "checkpoint.resume": ["", "auto"],
    "checkpoint.init_from": ["", "/nonexistent/hf_model", "share"],
}
GARBAGE = st.sampled_from(['"x"', "[1, 2]", "{a = 1}", "1979-05-27", "true", "''", "1e999",
                           "-inf", "nan", "0x10", "1_000", "'unterminated", "", "  "])
BIG = [-2**63, -2**31, 2**31, 2**63 - 1, 2**63, 10**30]


INTS = {  # keys whose interesting values are not small numbers
    "model.vocab_size": [1, 2, 100, 126, 127, 200, 256, 50257, -256],
    "train.global_batch_size": [0, 1, 2, 4, 8, 15, 16, 32, 64, 257, 4096, -1],
    "train.micro_batch_size": [0, 1, 2, 4, 3, -1],
    "train.seq_len": [0, 1, 8, 16, 15, 64, 100000, -16],
}


def _int_literal(key: str, default: int):
    small = st.sampled_from(INTS[key]) if key in INTS else st.integers(-3, 20)
    return st.one_of(small.map(str), small.map(str), small.map(str),
                     st.sampled_from(BIG).map(str), st.just(str(default)))


def _float_literal(key: str, default: float):
    if key in ("data.corpus_mb",):  # valid ones are read (embedded corpus): a few sizes only
        return st.sampled_from(["0.5", "0.25", "0", "-1", "nan", "inf", "1e-9"])
    if key in ("data.val_fraction",):
        return st.sampled_from(["0.05", "0.0", "0.5", "0.99", "1.0", "-0.1", "nan"])
    plain = st.floats(-2, 2, allow_nan=False).map(repr)
    odd = st.sampled_from(["nan", "inf", "-inf", "0", "-0.0", "1e-12", "1e308", "1e400",
                           "-1e308", "3", "-5"])
    return st.one_of(plain, plain, plain, odd, st.just(repr(default)))


def literal(section: str, key: str, default, wild: bool = True):
    """A TOML literal for ``section.key``: of the right type (``wild``: mostly)."""
    name = f"{section}.{key}"
    if name in CHOICES:
        right = st.sampled_from(CHOICES[name]).map(lambda v: f'"{v}"')
    elif isinstance(default, bool):
        right = st.sampled_from(["true", "false", "True", "1"])
    elif isinstance(default, int):
        right = _int_literal(name, default)
    elif isinstance(default, float):
        right = _float_literal(name, default)
    elif isinstance(default, dict):
        right = st.sampled_from(["{striping_factor = 4}", "{}", "4", '"x"'])
    else:
        right = st.text(alphabet="abc,-_:@ 0123", max_size=8).map(lambda v: f'"{v}"')
    if not wild:
        return right
    return st.integers(0, 11).flatmap(lambda i: GARBAGE if i == 0 else right)


@st.composite
def override(draw, wild: bool = True) -> str:
    """One ``--set`` string: a real key, or (``wild``, sometimes) an unknown or malformed one."""
    kind = draw(st.sampled_from(["key"] * 18 + ["unknown", "malformed"])) if wild else "key"
    if kind == "key":
        section, key, default = draw(st.sampled_from(KEYS))
        return f"{section}.{key}={draw(literal(section, key, default, wild))}"
    if kind == "unknown":
        section, key, _ = draw(st.sampled_from(KEYS))
        return draw(st.sampled_from([f"{section}.{key}x=1", f"nosuch.{key}=1",
                                     f"{section}.{key}.deeper=1", f"{section.upper()}.{key}=1"]))
    return draw(st.one_of(
        st.sampled_from(["steps=3", "=3", "train.steps", ".steps=1", "train.=1", "", ".=",
                         "train.steps==3", "train steps=3", "model..d_model=32"]),
        st.text(alphabet=st.characters(blacklist_categories=("Cs",),
                                       blacklist_characters="\x00"), max_size=12)))


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (2, 1, 2), (1, 2, 2),
           (4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 2), (1, 8, 1), (8, 1, 1), (1, 1, 8)]


@st.composite
def case(draw, wild: bool = True, world: int | None = None):
    """(TOML text of the config file or None for tiny.toml, [--set strings], world size).
    Not ``wild``: known keys, values of the right type (plausible to absurd), tiny.toml."""
    dp, tp, pp = draw(st.sampled_from(LAYOUTS))
    sets = [f"topology.dp={dp}", f"topology.tp={tp}", f"topology.pp={pp}"]
    sets += draw(st.lists(override(wild), max_size=6))
    if world is None:
        world = draw(st.one_of(st.just(dp * tp * pp), st.just(dp * tp * pp),
                               st.integers(-1, 16) if wild else st.integers(1, 16)))
    toml = None
    if wild and draw(st.integers(0, 4)) == 0:  # a config file of its own, sometimes broken
        tables: dict[str, dict[str, str]] = {}
        for item in draw(st.lists(override(), max_size=6)):
            lhs, _, rhs = item.partition("=")
            section, _, key = lhs.partition(".")
            tables.setdefault(section, {})[key] = rhs
        text = "\n".join(f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in body.items())
                         for name, body in tables.items())
        toml = draw(st.sampled_from([text] * 4 + [text + "\n[model\n",
                                                  "[model]\nn_layers = 8\n[model]\n"]))
    return toml, sets, world


def config_path(tmp_dir: Path, toml: str | None) -> str:
    if toml is None:
        return TINY
    p = tmp_dir / "fuzz.toml"
    p.write_text(toml, encoding="utf-8", errors="surrogatepass")
    return str(p)


def expected(path: str, sets: list[str], world: int, inputs) -> str | None:
    """The configuration error the CLI must report (None: none). ``inputs(cfg)`` checks what
    the config points at (data, directories) and raises ConfigError."""
    from hpctrain.checks.validate import validate

    try:
        cfg = load(path, sets)
        validate(cfg, world)
        inputs(cfg)
    except ConfigError as e:
        return str(e)
    return None


def template(message: str) -> set[str]:
    """The rules behind a message: one per listed problem, values replaced by placeholders."""
    lines = [x.removeprefix("  - ") for x in message.splitlines()
             if x not in ("invalid configuration:", "invalid input:")]
    out = set()
    for line in lines:
        kind = re.match(r"\S+ must be (an integer|a number|a string|true or false|a table|"
                        r"a finite number|a 64-bit integer), got", line)
        if kind or line.startswith(("unknown key", "unknown section")):
            out.add(f"KEY must be {kind[1]}" if kind else " ".join(line.split()[:2]))
            continue
        if "not valid TOML" in line or "must look like section.key=value" in line:
            out.add("not valid TOML" if "TOML" in line else "override must look like s.k=v")
            continue
        line = re.sub(r"(?<![\w.*])(/[^\s:,;)]+)+", "PATH", line)
        line = re.sub(r"'[^']*'|\"[^\"]*\"", "S", line)
        line = re.sub(r"=[^\s:;,)]+", "=V", line)
        line = re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", line)
        out.add(line[:90])
    return out
