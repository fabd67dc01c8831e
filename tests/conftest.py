"""Fixtures for every test. The checkout and tests/ are on ``sys.path`` by pytest's
``pythonpath`` setting (pyproject.toml), so tests import hpctrain, ``benchmarks`` and the
helper modules here (``launch``, ``fakes``, ``corpus_files``, ``fuzz_configs``) by name."""

from pathlib import Path

import pytest

# tests/run_all.sh runs tests/unit and tests/e2e on two pytest-xdist workers, a module's
# tests on one (--dist loadfile: its module fixtures are made once; only test_slurm.py
# submits to the local SLURM). The longest modules go first so that none is left running
# alone at the end.
FIRST = ("test_fault_campaign", "test_bench", "test_fuzz_foreign", "test_faults",
         "test_cli_layouts", "test_slurm", "test_local_tiers", "test_checkpoint_async",
         "test_resume_checks", "test_perf",
         "test_checkpoint", "test_docs_examples", "test_cluster", "test_cli",
         "test_eval_lineage", "test_relaunch_cluster")
SLOW_S = 30  # a test whose setup and call take longer carries @pytest.mark.slow(reason=...)
_SETUP_S: dict = {}  # test id -> its setup's seconds (a module fixture's cost lands there)
_UNMARKED: list = []  # (seconds, test id) of slow tests without the marker


def pytest_collection_modifyitems(config, items):
    """The longest modules first."""
    first = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: first.get(item.path.stem, len(FIRST)))


def pytest_runtest_logreport(report):
    """Remember a test whose setup + call took over SLOW_S without a ``slow`` marker."""
    if report.when == "setup":
        _SETUP_S[report.nodeid] = report.duration
    elif report.when == "call":
        took = _SETUP_S.pop(report.nodeid, 0.0) + report.duration
        if took > SLOW_S and "slow" not in report.keywords:
            _UNMARKED.append((took, report.nodeid))


def pytest_terminal_summary(terminalreporter):
    """The suite keeps its time budget in view: a slow test must say why it is slow."""
    if _UNMARKED:
        terminalreporter.section(f"tests over {SLOW_S} s without a slow(reason=...) marker")
        for seconds, nodeid in sorted(_UNMARKED, reverse=True):
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")


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
