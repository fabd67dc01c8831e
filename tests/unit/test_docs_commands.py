"""Every ``hpctrain ...`` command line written in README.md and docs/*.md (in fenced bash
blocks or in backquotes) is one the CLI takes: the subcommand exists, each option is one of
its options (spelled out, no abbreviation), a value is one of the option's choices, and every
``--set section.key=value`` names a config key. Placeholders (``CONFIG``, ``N``, ``...``,
``$VAR``) are not judged, nor which positionals are given."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from hpctrain.__main__ import build_parser
from hpctrain.config import Config, toml_key

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^([ \t]*)```(bash|sh|shell|console)[ \t]*\n(.*?)^\1```", re.M | re.S)
SPAN = re.compile(r"`([^`]+)`")
STARTS = re.compile(r"(mpirun|srun|mpiexec|python3?|\S*hpctrain)\s")
OPERATORS = {"&&", "||", ";", "|", ">", ">>", "<", "2>", "&", "2>&1", "(", ")"}
KEYS = {f"{s.name}.{toml_key(f.name)}" for s in dataclasses.fields(Config)
        for f in dataclasses.fields(s.default_factory())}


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)),
                  None)
    return dict(action.choices) if action else {}


PARSER = build_parser()


def placeholder(word: str) -> bool:
    """CONFIG, RUN_DIR, N, NAME:SLOTS, <dir>, $SCRATCH/x, ..., [--set ...]."""
    w = word.strip("[]")
    return (not w or "..." in w or w.startswith(("$", "<")) or "$" in w
            or bool(re.fullmatch(r"[A-Z][A-Z0-9_.:|,/=-]*", w.split("=")[0])))


def command_lines(text: str) -> list[str]:
    """The command lines of a page: each fenced bash block's lines (continuations joined,
    comments dropped) and each backquoted span that starts like a command."""
    out = []
    for m in FENCE.finditer(text):
        body = re.sub(r"\\\n\s*", " ", m.group(3))
        out += [line for line in body.splitlines() if "hpctrain" in line]
    prose = re.sub(r"^([ \t]*)```.*?^\1```", "", text, flags=re.M | re.S)
    out += [" ".join(m.group(1).split()) for m in SPAN.finditer(prose)
            if STARTS.match(m.group(1)) and "hpctrain" in m.group(1)]
    return out


def invocations(line: str) -> list[list[str]]:
    """The argument lists of each ``hpctrain`` call of one command line (``hpctrain``,
    ``.../hpctrain``, ``-m hpctrain``; ``hpctrain launch ... -- hpctrain train ...`` is two)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>()")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        words = list(lexer)
    except ValueError:  # an unbalanced quote in prose
        return []
    out, current = [], None
    for i, w in enumerate(words):
        if w in OPERATORS:
            current = None
            continue
        if (w == "hpctrain" or w.endswith("/hpctrain")) and \
                not (i > 0 and words[i - 1] in ("import", "from", "install", "cd")):
            current = []
            out.append(current)
        elif current is not None:
            current.append(w)
    return out


def problems(args: list[str]) -> list[str]:
    """What in one ``hpctrain`` argument list the parser would not take."""
    if not args or placeholder(args[0]) or args[0] in ("--help", "-h", "--version") \
            or args[0].endswith(":"):  # a message quoted: "hpctrain train: rank 3: ..."
        return []
    parser, name = PARSER, "hpctrain"
    while args and (subs := subparsers(parser)):
        if placeholder(args[0]) or args[0] in ("--help", "-h"):  # hpctrain tokenizer ACTION
            return []
        if args[0] not in subs:
            return [f"{name}: no command {args[0]!r}"]
        name, parser, args = f"{name} {args[0]}", subs[args[0]], args[1:]
    if getattr(parser.get_default("_module"), "VERBATIM", False):  # submit: an sbatch line
        at = next((i for i, w in enumerate(args) if w.endswith(".sbatch")), len(args))
        return problems(["train", *args[at + 1:]])  # after the template: train's arguments
    options = {o: a for a in parser._actions for o in a.option_strings}
    found, i = [], 0
    while i < len(args):
        word = args[i].strip("[]")
        i += 1
        if word == "--":  # launch: the rest is the command (its own hpctrain is read apart)
            break
        if not word.startswith("-") or word == "-" or re.fullmatch(r"-\d.*", word):
            continue
        opt, eq, value = word.partition("=")
        action = options.get(opt)
        if action is None:
            found.append(f"{name}: no option {opt}")
            continue
        if action.nargs == 0:
            continue
        if not eq:
            if i >= len(args):
                continue
            value, i = args[i].strip("[]"), i + 1
        if placeholder(value):
            continue
        if action.choices and value not in action.choices:
            found.append(f"{name} {opt}: {value!r} is not one of {sorted(action.choices)}")
        if action.dest == "overrides":
            key = value.split("=")[0]
            if key not in KEYS:
                found.append(f"{name} --set {key}: no such config key")
    return found


def page_problems(page: Path) -> list[str]:
    out = []
    for line in command_lines(page.read_text(encoding="utf-8")):
        for args in invocations(line):
            out += [f"{p}  [in: {line.strip()[:100]}]" for p in problems(args)]
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_written_in_the_docs_parses(page):
    bad = page_problems(page)
    assert not bad, f"{page.name}:\n" + "\n".join(bad)


def test_the_docs_show_commands_at_all():
    n = sum(len(invocations(line)) for p in PAGES
            for line in command_lines(p.read_text(encoding="utf-8")))
    assert n > 50


@pytest.mark.parametrize("line,expected", [
    ("hpctrain train CONFIG --run-dir runs/x --set train.steps=10", []),
    ("mpirun -n 4 hpctrain train c.toml --run-dir r --set optim.lr=1e-3 --set x.y=1",
     ["hpctrain train --set x.y: no such config key"]),
    ("hpctrain train c.toml --rundir r", ["hpctrain train: no option --rundir"]),
    ("hpctrain trian c.toml", ["hpctrain: no command 'trian'"]),
    ("hpctrain export CKPT out --format onnx",
     ["hpctrain export --format: 'onnx' is not one of ['dcp', 'hf', 'safetensors']"]),
    ("hpctrain launch -n 4 -- hpctrain train c.toml --run-dir r --sett x=1",
     ["hpctrain train: no option --sett"]),
    ("hpctrain tokenizer train --embedded --vocab-size 512 --out t.json", []),
    ("hpctrain tokenizer fit x", ["hpctrain tokenizer: no command 'fit'"]),
    ("hpctrain plan CONFIG [--set ...] --search --cluster NAME", []),
    ("python -m mpi4py -m hpctrain train c.toml --run-dir r && hpctrain report r --stp 3",
     ["hpctrain report: no option --stp"]),
])
def test_a_renamed_option_or_key_is_caught(line, expected):
    assert [p for args in invocations(line) for p in problems(args)] == expected
