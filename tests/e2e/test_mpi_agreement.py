"""tests/agreement.py (the hook of tests/mpi and tests/matrix): a test that fails or skips on
one rank does so on every rank, at once, instead of leaving the other ranks in a collective
until the 600 s timeout.

Each case runs ``pytest`` under ``mpirun -n 2`` on a temporary test file next to a copy of
tests/mpi/conftest.py and tests/agreement.py, as tests/run_all.sh runs tests/mpi."""

import json
import shutil
import time

import pytest
from launch import ROOT, mpirun

pytestmark = pytest.mark.e2e

RANK = "from mpi4py import MPI\nW = MPI.COMM_WORLD\nR = W.Get_rank()\n\n"

OUTCOMES = RANK + '''import pytest

@pytest.fixture
def fails_on_rank_1():
    assert R != 1, "fixture broke on rank 1"

def test_fails_on_rank_1_after_collectives():
    total = W.allreduce(1)
    assert R != 1, f"rank 1 disagrees with {total}"

def test_collective_after_a_failure():
    assert W.allreduce(R) == 1

def test_skipped_on_rank_0_only():
    W.Barrier()
    if R == 0:
        pytest.skip("nothing to do on rank 0")

def test_setup_error_on_rank_1(fails_on_rank_1):
    W.Barrier()

def test_collective_after_maxfail():
    W.Barrier()
'''

MIDWAY = RANK + '''
def test_fails_on_rank_1_between_collectives():
    W.Barrier()
    assert R != 1, "rank 1 fails before the second barrier"
    W.Barrier()

def test_next():  # rank 1 would go on to this all-reduce: rank 0 is in a barrier: a hang
    assert W.allreduce(1) == 2
'''


# A plugin that writes what each rank's pytest reported: RANKLOG/rank<R>.json holds
# {test: [outcome per phase that did not pass, or "passed"], ...} and the messages.
RANKLOG = RANK + """import json, os

OUT = {}

def pytest_runtest_logreport(report):
    name = report.nodeid.split("::")[-1]
    if report.when == "call" or report.outcome != "passed":
        OUT.setdefault(name, []).append([report.when, report.outcome, str(report.longrepr)])

def pytest_sessionfinish(session, exitstatus):
    with open(os.path.join(os.environ["RANKLOG"], f"rank{R}.json"), "w") as f:
        json.dump(OUT, f)
"""


def run_pytest(tmp_path, source: str, *args, timeout: float):
    shutil.copy(ROOT / "tests" / "mpi" / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(ROOT / "tests" / "agreement.py", tmp_path / "agreement.py")
    (tmp_path / "test_case.py").write_text(source)
    (tmp_path / "ranklog.py").write_text(RANKLOG)
    t0 = time.monotonic()
    proc = mpirun(2, ["-m", "pytest", "-p", "no:cacheprovider", "-p", "ranklog", "-q",
                      "--color=no", "--rootdir", str(tmp_path), "-o", "timeout=0", *args,
                      str(tmp_path / "test_case.py")],
                  timeout=timeout, check=False,
                  extra_env={"HPCTRAIN_TEST_ALONE_S": "3", "RANKLOG": tmp_path,
                             "PYTHONPATH": tmp_path})
    return proc, time.monotonic() - t0


def outcomes(tmp_path, rank: int) -> dict:
    """{test: [(phase, outcome, message), ...]} as rank ``rank``'s pytest reported them."""
    return json.loads((tmp_path / f"rank{rank}.json").read_text())


def test_outcomes_agree_across_ranks_and_maxfail_stops_all(tmp_path):
    # Without agreement rank 0 reports passes where rank 1 failed, and rank 1 stops after
    # two failures while rank 0 (no failure) waits in the last test's barrier for ever.
    proc, took = run_pytest(tmp_path, OUTCOMES, "--maxfail=2", timeout=120)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode != 0 and took < 90, (took, out)
    r0, r1 = outcomes(tmp_path, 0), outcomes(tmp_path, 1)
    kinds = {t: [(w, o) for w, o, _ in v] for t, v in r0.items()}
    assert kinds == {t: [(w, o) for w, o, _ in v] for t, v in r1.items()}, (r0, r1)
    assert kinds == {"test_fails_on_rank_1_after_collectives": [("call", "failed")],
                     "test_collective_after_a_failure": [("call", "passed")],
                     "test_skipped_on_rank_0_only": [("call", "skipped")],
                     "test_setup_error_on_rank_1": [("setup", "failed")]}, kinds
    # (--maxfail=2 stopped both ranks before test_collective_after_maxfail)
    msg = r0["test_fails_on_rank_1_after_collectives"][0][2]
    assert "call failed on rank 1 of 2 (passed on rank 0)" in msg, msg
    assert "rank 1 disagrees with 2" in msg, msg
    assert "fixture broke on rank 1" in r0["test_setup_error_on_rank_1"][0][2]
    skip = r1["test_skipped_on_rank_0_only"][0][2]
    assert "skipped on rank 0: rank 0: nothing to do on rank 0" in skip, skip


def test_a_rank_failing_between_collectives_ends_the_job(tmp_path):
    # Rank 0 waits in the second barrier, which rank 1 never reaches: no outcome can rescue
    # rank 0, so rank 1 reports its failure and aborts after HPCTRAIN_TEST_ALONE_S (3 s).
    proc, took = run_pytest(tmp_path, MIDWAY, timeout=120)
    assert proc.returncode != 0
    assert "rank 1 fails before the second barrier" in proc.stderr, proc.stderr[-4000:]
    assert "did not finish this test within 3 s" in proc.stderr, proc.stderr[-4000:]
    assert took < 90, took
