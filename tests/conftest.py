"""Fixtures for every test. The checkout and tests/ are on ``sys.path`` by pytest's
``pythonpath`` setting (pyproject.toml), so tests import hpctrain, ``benchmarks`` and the
helper modules here (``launch``, ``fakes``, ``corpus_files``, ``fuzz_configs``) by name."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory) -> Path:
    """A directory shared by the whole session (cached one-rank baselines live here)."""
    return tmp_path_factory.mktemp("session")
