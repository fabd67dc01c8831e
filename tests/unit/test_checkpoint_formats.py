"""Checkpoint formats are one registry (interchange/formats.py): ``hpctrain import`` and
``export`` take their ``--format`` choices and their dispatch from it, ``init_from`` its
source kinds; a format added there is offered and used with no other change. A source in no
format, or in one a run cannot start from, is one message naming the formats or the command."""

from __future__ import annotations

import dataclasses

import pytest

from hpctrain.__main__ import build_parser, main
from hpctrain.interchange import InterchangeError, formats, init_from


def choices(command: str) -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return next(a for a in sub._actions if a.dest == "format").choices


def test_cli_choices_are_the_registry():
    assert choices("import") == ["auto", *formats.names("reads")] == ["auto", "hf", "dcp"]
    assert choices("export") == formats.names("writes") == ["hf", "dcp", "safetensors"]


def test_a_registered_format_is_offered_detected_and_called(tmp_path, monkeypatch, capsys):
    """One Format line: import offers it, auto-detects it and calls its reader."""
    calls = []

    def reads(source, out, options, say):
        calls.append((source, out, options.dtype))
        say(f"read {source.name}")
        return out

    toy = formats.Format("toy", "a toy directory (toy.json)", lambda p: (p / "toy.json").is_file(),
                         reads, None, False, False, "nothing", "")
    monkeypatch.setattr(formats, "FORMATS", (*formats.FORMATS, toy))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "toy.json").write_text("{}")
    assert "toy" in choices("import") and "toy" not in choices("export")
    rc = main(["import", str(tmp_path / "src"), "--out", str(tmp_path / "o.h5"),
               "--dtype", "float64"])
    assert rc == 0 and calls == [(tmp_path / "src", tmp_path / "o.h5", "float64")]
    assert "read src" in capsys.readouterr().out


def test_a_source_in_no_format_names_the_formats(tmp_path, capsys):
    (tmp_path / "nothing").mkdir()
    rc = main(["import", str(tmp_path / "nothing"), "--out", str(tmp_path / "o.h5")])
    err = capsys.readouterr().err
    assert rc == 2 and "in no format hpctrain imports" in err and "hf:" in err and "dcp:" in err
    assert not (tmp_path / "o.h5").exists()


def test_a_dcp_source_needs_its_config(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".metadata").write_bytes(b"")
    rc = main(["import", str(tmp_path / "d"), "--out", str(tmp_path / "o.h5")])
    assert rc == 2 and "give --config" in capsys.readouterr().err


def test_init_from_a_dcp_directory_says_to_import_it(tmp_path):
    (tmp_path / ".metadata").write_bytes(b"")
    with pytest.raises(InterchangeError, match="hpctrain import .* --format dcp --config"):
        init_from.source_kind(str(tmp_path))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    assert init_from.source_kind(str(tmp_path / "hf")) == ("hf", tmp_path / "hf")


def test_every_format_says_what_it_carries():
    for f in formats.FORMATS:
        assert f.what and f.carries and (f.reads or f.writes), dataclasses.asdict(f)
        assert f"`{f.name}`" in formats.markdown()
