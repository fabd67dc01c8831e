"""Fixtures for every test. The checkout and tests/ are on ``sys.path`` by pytest's
``pythonpath`` setting (pyproject.toml), so tests import hpctrain, ``benchmarks`` and the
helper modules here (``launch``, ``fakes``, ``corpus_files``, ``fuzz_configs``) by name."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    """A directory shared by the whole session (cached one-rank baselines live here)."""
    return tmp_path_factory.mktemp("session")


@pytest.fixture
def cli(capsys):
    """The one-process commands (import, export, inspect, generate) through the CLI's own
    ``main``, in this process (no interpreter start per call): (exit code, stdout, stderr)."""
    from hpctrain.__main__ import main

    def call(*args):
        capsys.readouterr()
        rc = main([str(a) for a in args])
        out = capsys.readouterr()
        return rc, out.out, out.err

    return call
