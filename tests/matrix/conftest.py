"""The equivalence matrix: many layouts inside one MPI launch (tests/inprocess.py), run by
tests/run_all.sh as ``launch -n 8 -- python -m mpi4py -m pytest --with-mpi tests/matrix``.
Every test is an MPI test; its directories (``tmp_path``, ``tmp_path_factory.mktemp``,
``session_dir``) are rank 0's on every rank, and the ranks agree on each outcome
(tests/agreement.py)."""

import os
import sys

import pytest
from agreement import pytest_runtest_makereport  # noqa: F401  (the hook pytest finds here)
from inprocess import same_path, world


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """Rank 0 speaks for the launch: the other ranks write no report and print nothing (their
    failures reach rank 0's report through the agreement, one line each)."""
    if world().rank != 0:
        config.option.xmlpath = None
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115  (for the process's lifetime)


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.mpi)


class SharedTmp:
    """pytest's ``tmp_path_factory`` whose directories rank 0 makes and every rank gets."""

    def __init__(self, factory):
        self._factory = factory

    def mktemp(self, name: str, numbered: bool = True):
        root = world().rank == 0
        return same_path(self._factory.mktemp(name, numbered) if root else None)

    def getbasetemp(self):
        return same_path(self._factory.getbasetemp() if world().rank == 0 else None)


@pytest.fixture(scope="session")
def tmp_path_factory(tmp_path_factory):
    return SharedTmp(tmp_path_factory)


@pytest.fixture
def tmp_path(tmp_path_factory, request):
    return tmp_path_factory.mktemp(request.node.name[:40])


@pytest.fixture(scope="session")
def session_dir(tmp_path_factory):
    """A directory shared by the whole launch (the one-rank baselines live here)."""
    return tmp_path_factory.mktemp("session")
