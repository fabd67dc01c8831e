"""``python -m benchmarks --smoke`` end to end at the tiny size: one command runs every
benchmark under mpirun, each part once at its smallest world size (scaling at the sizes it
compares), writes bench.json and bench.md of the documented shape, and both sides of every
comparison computed the same thing (no timing is asserted: the machine is shared). No other
test runs the benchmarks' code."""

import json
import math

import pytest
from launch import benchmarks

pytestmark = pytest.mark.e2e

PAIRS = {  # benchmark -> (ranks, variants that must both appear)
    "gradsync": ((2,), ("hpctrain bucketed", "per-parameter", "limit: one Allreduce")),
    "ddp": ((2,), ("hpctrain dp (MPI, bucketed)", "torch DDP (gloo)")),
    "pipeline": ((2,), ("hpctrain 1f1b", "torch Schedule1F1B",
                          "hpctrain 1f1b, spinning MPI_Wait")),
    "overhead": ((1,), ("hpctrain train", "plain PyTorch loop")),
    "scaling": ((1, 2, 4), ("naive (per-parameter, blocking, placement naive)",
                            "hpctrain (bucketed, overlap across nodes, placement auto)")),
    "overlap": ((2,), ("compute only (no sync)", "no overlap: blocking buckets after backward",
                         "overlap, progress wait (libnbc)",
                         "overlap, progress test (libnbc + MPI_Test in hooks)",
                         "overlap, progress thread",
                         "overlap, progress poll (progress thread, libnbc + MPI_Test)",
                         "per-parameter (naive)")),
}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # a guard against a hung launch, not a speed check: the smoke takes about 180 s on a
    # quiet 2-core machine and over 400 s beside another suite's launches (load 13-20)
    proc = benchmarks(["--size", "tiny", "--repeats", "1", "--smoke", "--out", str(out)],
                      timeout=1200, check=False)
    doc = json.loads((out / "bench.json").read_text())
    return proc, doc, (out / "bench.md").read_text()


def _results(doc, name):
    return [r for r in doc["results"] if r["bench"] == name]


@pytest.mark.slow(reason="every benchmark part: three launches and two simulated clusters")
def test_every_part_ran_and_command_succeeded(bench):
    proc, doc, _ = bench
    failed = [r for r in doc["results"] if "error" in r]
    assert not failed, failed
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {"date", "host", "torch", "mpi"} <= set(doc["meta"])
    assert doc["size"] == "tiny" and doc["repeats"] == 1


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_comparison_shape_and_same_result(bench, name):
    _, doc, _ = bench
    ranks, variants = PAIRS[name]
    results = _results(doc, name)
    assert sorted(r["ranks"] for r in results) == sorted(ranks)
    for r in results:
        assert [row["variant"] for row in r["rows"]] == list(variants)
        for row in r["rows"]:
            assert row["median"] > 0 and len(row["samples"]) >= 1
        # Overhead may be negative (hpctrain faster); every ratio must be a number.
        assert r["ratios"] and all(math.isfinite(q["value"]) and q["target"]
                                   for q in r["ratios"])
        check = r["check"]
        assert check["ok"], (name, r["ranks"], check)
        if name not in ("gradsync", "overlap"):  # training: every side's losses, same, finite
            losses = list(check["values"].values())
            assert len(losses) == len(r["rows"]) and len(losses[0]) >= 2
            assert all(len(v) == len(losses[0]) for v in losses)
            assert check["rel_err"] <= 1e-4


def test_every_comparison_has_ratio_target_met_and_load(bench):
    """bench.json lists every comparison flat (ratio, target, met; spread and noise when
    paired) and each part records the machine load before and after it; the scaling part
    has each design's efficiency from 1 to 2 and 4 ranks."""
    _, doc, md = bench
    comps = doc["comparisons"]
    assert len(comps) == sum(len(r.get("ratios", [])) for r in doc["results"]) > 0
    for c in comps:
        assert {"bench", "ranks", "ratio", "target", "met"} <= set(c)
        assert isinstance(c["met"], bool) and math.isfinite(c["ratio"])
        assert c["spread"] is None or c["spread"][0] <= c["ratio"] <= c["spread"][1]
        assert (c["why"] is None) == c["met"], c  # every missed target says why
        if not c["met"]:
            assert f"{c['name']} = {c['ratio']:.3g} (target {c['target']}): {c['why']}" in md
    assert all(len(r["load"]["before"]) == 3 and len(r["load"]["after"]) == 3
               for r in doc["results"] if "error" not in r)
    eff = {c["name"] for c in comps if c["bench"] == "scaling"}
    assert {f"efficiency 1->{n} ranks, {d}" for n in (2, 4) for d in ("naive", "hpctrain")} \
        <= eff, eff
    assert "load before / after" in md


def test_data_part_rows(bench):
    """The data part on one rank: prepare against the library, and the training figures
    (data share of a step with and without read-ahead, peak RSS on two corpora 10x apart),
    every one a finite number, both training ratios listed."""
    _, doc, _ = bench
    results = {r["ranks"]: r for r in _results(doc, "data")}
    assert sorted(results) == [1]
    for r in results.values():
        assert r["check"]["ok"], r["check"]
        assert all(math.isfinite(row["median"]) and row["median"] > 0 for row in r["rows"])
    rows = {row["variant"] for row in results[1]["rows"]}
    assert {"train: data share of a step, read-ahead on",
            "train: data share of a step, read-ahead off",
            "train: peak RSS, 0.3 MiB corpus", "train: peak RSS, 3 MiB corpus"} <= rows, rows
    names = {q["name"]: q for q in results[1]["ratios"]}
    share = names["train: data share of a step with read-ahead"]
    rss = names["train: peak RSS, 3 MiB / 0.3 MiB corpus"]
    assert 0 <= share["value"] < 1 and math.isfinite(rss["value"]) and rss["value"] > 0


def test_collectives_table(bench):
    _, doc, md = bench
    (res,) = _results(doc, "collectives")
    table = res["table"]
    axes = {(r["axis"], r["ranks"]) for r in table}
    assert axes == {("tp", 2), ("dp", 2), ("world", 4)}
    assert {r["op"] for r in table} == {"allreduce", "allgather", "reduce_scatter",
                                         "alltoall", "sendrecv"}
    assert all(r["latency_us"] > 0 and r["bw_MBps"] > 0 for r in table)
    assert "| axis (ranks) | bytes |" in md and "| benchmark | ranks |" in md


def test_bad_input_is_a_clear_error(tmp_path):
    proc = benchmarks(["--repeats", "0", "--out", str(tmp_path)], check=False)
    assert proc.returncode == 2 and "--repeats must be >= 1" in proc.stderr
    proc = benchmarks(["--only", "nonsense", "--out", str(tmp_path)], check=False)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_a_part_out_of_its_budget_is_reported_and_the_rest_kept(tmp_path, monkeypatch, capsys):
    """Each part runs in its own launch within its own budget: one that runs out is stopped
    (no rank left behind) and reported, and the part before it stays in bench.json."""
    import subprocess

    from benchmarks import driver

    monkeypatch.setitem(driver.BUDGETS, "gradsync", 3)  # a third at --size tiny: 1 s
    rc = driver.main(["--only", "overhead", "--only", "gradsync", "--size", "tiny",
                      "--repeats", "1", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "bench.json").read_text())
    by_name = {r["bench"]: r for r in doc["results"]}
    assert rc == 1 and "error" not in by_name["overhead"], by_name["overhead"]
    assert "ran out of its budget (1 s" in by_name["gradsync"]["error"]
    # this launch's ranks only (their --out is under tmp_path): the smoke test may be running
    # its own gradsync on another worker
    left = subprocess.run(["pgrep", "-f", f"benchmarks.worker gradsync .*{tmp_path}"],
                          capture_output=True)
    assert left.returncode == 1, left.stdout
    assert "gradsync: FAILED: ran out of its budget" in capsys.readouterr().out


def test_a_stopped_part_runs_its_cleanup(tmp_path):
    """The driver stops a part with SIGTERM: the worker ends through SystemExit, so a part's
    ``finally`` (taking its simulated cluster down) runs before the SIGKILL that follows."""
    import signal
    import subprocess
    import sys
    import time

    done = tmp_path / "cleaned"
    code = ("import time\nfrom benchmarks.worker import stop_cleanly\nstop_cleanly()\n"
            f"try:\n    print('up', flush=True)\n    time.sleep(60)\n"
            f"finally:\n    open({str(done)!r}, 'w').write('down')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 128 + signal.SIGTERM and time.monotonic() - t0 < 5
    assert done.read_text() == "down"
