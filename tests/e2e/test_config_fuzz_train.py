"""Property-based (Hypothesis), through the real entry point: ``python -m hpctrain train``
refuses any invalid configuration drawn by tests/fuzz_configs.py before any collective:
exit 2, exactly the message the configuration and its inputs earn (one, by rank 0), no
traceback, and the existing run directory untouched. A handful of examples as a 1-rank MPI
singleton, two under ``mpirun -n 2`` (world-size-dependent checks); valid draws are skipped
(training them is what every other e2e test does). Derandomized for CI."""

import time

import pytest
from fuzz_configs import case, config_path, expected, template
from hypothesis import HealthCheck, assume, example, given, settings
from launch import hpctrain, mpirun

from hpctrain.checks.inputs import check_inputs

pytestmark = pytest.mark.e2e

EXAMPLES = 10  # each a process (torch and MPI start-up); the in-process fuzz draws hundreds

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.filter_too_much])


def _run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    (run_dir / "config.toml").write_text("# an earlier run's\n")
    return run_dir


def _contents(run_dir) -> dict:
    return {p.name: p.read_bytes() for p in sorted(run_dir.iterdir())}


def _args(path: str, run_dir, sets: list[str]) -> list[str]:
    return ["train", path, "--run-dir", str(run_dir), *(f"--set={s}" for s in sets)]


def _refusal(tmp_path, example, world: int) -> tuple[str, object]:
    toml, sets, _ = example
    run_dir = _run_dir(tmp_path)
    path = config_path(tmp_path, toml)
    want = expected(path, sets, world, lambda cfg: check_inputs(cfg, str(run_dir)))
    assume(want is not None)
    return want, run_dir


def test_train_refuses_invalid_configs_alone(tmp_path):
    rules: set[str] = set()
    t0 = time.perf_counter()

    @settings(max_examples=EXAMPLES, **SETTINGS)
    @given(case(world=1))
    # Two rules every run reaches, whatever the draws (an unknown key, a malformed override):
    # the rule count below then measures the fuzz, not its luck.
    @example((None, ["topology.dp=1", "topology.tp=1", "topology.pp=1", "nosuch.steps=1"], 1))
    @example((None, ["topology.dp=1", "topology.tp=1", "topology.pp=1", "train.=1"], 1))
    def check(example):
        want, run_dir = _refusal(tmp_path, example, 1)
        before = _contents(run_dir)
        proc = hpctrain(_args(config_path(tmp_path, example[0]), run_dir, example[1]),
                        check=False)
        assert proc.returncode == 2, (example, proc.stderr[-3000:])
        assert proc.stderr.strip() == f"hpctrain train: {want}", (example, proc.stderr)
        assert _contents(run_dir) == before
        rules.update(template(want))

    check()
    print(f"\nconfig fuzz (train, 1 rank): {EXAMPLES} examples in "
          f"{time.perf_counter() - t0:.1f} s, {len(rules)} distinct rules fired")
    assert len(rules) >= 5, rules


def test_train_refuses_invalid_configs_on_every_rank(tmp_path):
    @settings(max_examples=2, **SETTINGS)
    @given(case(wild=False, world=2))
    def check(example):
        want, run_dir = _refusal(tmp_path, example, 2)
        before = _contents(run_dir)
        args = _args(config_path(tmp_path, example[0]), run_dir, example[1])
        proc = mpirun(2, ["-m", "hpctrain", *args], check=False, timeout=120)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert proc.stderr.count("hpctrain train: ") == 1, proc.stderr
        assert f"hpctrain train: {want}\n" in proc.stderr, (example, proc.stderr)
        assert _contents(run_dir) == before

    check()
