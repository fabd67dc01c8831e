"""The CLI explains itself: every option's help shows its default (or says it is required),
the top-level help is written for users, and a safetensors export is named *.safetensors."""

import argparse
import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from hpctrain.__main__ import COMMANDS, build_parser
from hpctrain.cli import about
from hpctrain.interchange.hf_export import safetensors_path


def parsers(parser, prefix="hpctrain"):
    """(name, parser) for the command and every (nested) subcommand."""
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{prefix} {name}")


def test_every_option_shows_its_default():
    missing = []
    for name, parser in parsers(build_parser()):
        assert parser.formatter_class is about.Formatter, name
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.nargs == 0 or action.nargs == argparse.PARSER:
                continue  # flags (off unless given), --help, --version, subcommands
            if action.required and not action.option_strings:
                continue  # a positional that must be given
            text = formatter._get_help_string(action)
            if "default" not in text and "(required)" not in text \
                    and action.nargs != argparse.REMAINDER:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"options whose help shows no default: {missing}"


def test_a_default_is_shown_once_and_as_given():
    p = argparse.ArgumentParser(formatter_class=about.Formatter)
    p.add_argument("--a", default=5, help="a number")
    p.add_argument("--b", default="def ", help="text")
    p.add_argument("--c", default="x", help="x (default: the usual)")
    p.add_argument("--d", required=True, help="needed")
    text = " ".join(p.format_help().split())
    assert "a number (default: 5)" in text and "text (default: 'def ')" in text
    assert "x (default: the usual)" in text and "needed (required)" in text
    assert text.count("default") == 3


def test_top_level_help_is_for_users():
    text = build_parser().format_help()
    assert "hpctrain trains large neural networks" in text
    assert "mpirun -n 4 hpctrain train" in text and "srun -n 4 hpctrain train" in text
    for name, line in COMMANDS.items():
        assert len(line) <= 56, f"{name}: its line would wrap at 80 columns"
        assert line in text


@given(st.text(alphabet="abc./_-", min_size=1, max_size=20))
def test_safetensors_export_is_named_safetensors(name):
    if name.endswith(("/", os.sep)) or os.path.isdir(name):
        assert safetensors_path(name).name == "model.safetensors"
        return
    out = safetensors_path(name)
    assert out.name.endswith(".safetensors")
    assert out == Path(name if name.endswith(".safetensors") else name + ".safetensors")


def test_safetensors_export_into_a_directory(tmp_path):
    assert safetensors_path(str(tmp_path)) == tmp_path / "model.safetensors"
    assert safetensors_path(f"{tmp_path}/new/") == tmp_path / "new" / "model.safetensors"
    assert safetensors_path(str(tmp_path / "m")) == tmp_path / "m.safetensors"
    assert safetensors_path(str(tmp_path / "m.safetensors")) == tmp_path / "m.safetensors"


def test_every_help_fits_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    wide = [f"{name}: {line}" for name, parser in parsers(build_parser())
            for line in parser.format_help().splitlines() if len(line) > 80]
    assert not wide, wide
