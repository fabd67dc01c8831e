"""The fault campaign in CI (benchmarks/faults.py; ``make bench`` runs the 100-fault one):
``python -m benchmarks --only faults --size tiny`` draws 9 faults from seed 1, one of every
kind (kill -9 of a rank mid-step, mid-HDF5 save, mid-local write, mid-partner exchange; a
preemption; SIGSTOP; a full local directory; a damaged newest checkpoint; a lost node), on 3
simulated nodes under ``hpctrain launch --relaunch --spare 1``. The run goes on by itself
after each, loses at most ``local_every`` steps (``every`` after the full local directory
switched the tier off), and its final parameters, optimizer state and data position equal
an uninterrupted run's byte for byte. Skipped where namespaces cannot be made (not root),
failed where they should."""

import json
import os
import shutil

import pytest
from launch import benchmarks

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

KINDS = {"kill-step", "kill-hdf5", "kill-local", "kill-partner", "sigterm", "sigstop",
         "full-local", "damaged-newest", "lost-node"}


@pytest.mark.slow(reason="9 faults, 9 relaunches or requeues on 3 simulated nodes")
def test_nine_faults_of_every_kind_cost_no_work_and_no_bit(tmp_path):
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("no simulated cluster here (needs root and iproute2)")
    proc = benchmarks(["--only", "faults", "--size", "tiny", "--repeats", "1", "--out",
                       str(tmp_path)], timeout=900, check=False)
    (res,) = json.loads((tmp_path / "bench.json").read_text())["results"]
    notes = "\n".join(res.get("notes", [])) or res.get("error", "")
    log = tmp_path / "parts" / "n1.log"
    assert proc.returncode == 0, notes + (log.read_text()[-6000:] if log.is_file() else "")
    table = res["table"]
    assert {f["kind"] for f in table} == KINDS, table
    assert all(not f["human"] and f["steps_lost"] is not None for f in table), notes
    bounds = [4 if i and table[i - 1]["kind"] == "full-local"
              and table[i - 1]["job"] == f["job"] else 1 for i, f in enumerate(table)]
    assert all(f["steps_lost"] <= b for f, b in zip(table, bounds)), table
    assert all(f["recover_s"] > 0 for f in table if f["kind"] != "full-local"), table
    assert "byte for byte equal" in notes, notes
    assert res["check"]["ok"] and res["check"]["values"] == [9, 9], res["check"]
