"""tests/mpi runs one pytest per rank under mpirun: every rank agrees on each test's outcome
(tests/agreement.py)."""

from agreement import pytest_runtest_makereport  # noqa: F401  (the hook pytest finds here)
