"""Property-based (Hypothesis): any configuration file, ``--set`` strings and world size
either validate, and then ``hpctrain plan --world-size N`` succeeds (exit 0, the plan on
stdout, nothing on stderr), or are refused with the configuration error: exit 2, exactly one
message ``hpctrain plan: ...`` on stderr, no traceback (an exception escaping ``main`` fails
the test). Derandomized: CI draws the same examples every time. The distinct rules that fired
are counted and printed (``pytest -s``) and must not fall below a floor, so the examples keep
reaching the refusals, and enough of them must be valid to reach the plan."""

import contextlib
import io
import time

from fuzz_configs import case, config_path, expected, template
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hpctrain.__main__ import main
from hpctrain.checks.inputs import check_plan_inputs as plan_inputs

EXAMPLES = 400


def run_plan(path: str, sets: list[str], world: int) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = ["plan", path, f"--world-size={world}", *(f"--set={s}" for s in sets)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(args)
    return rc, out.getvalue(), err.getvalue()


def test_any_config_is_planned_or_refused_with_one_message(tmp_path):
    rules: set[str] = set()
    seen = {"valid": 0, "refused": 0}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.one_of(case(wild=False), case()))
    @example((None, ["model.vocab_size=100"], 1))  # the data's largest id (126): no row
    @example((None, ["model.vocab_size=127", "train.eval_every=1", "data.val_fraction=0.0"], 1))
    def check(example):
        toml, sets, world = example
        path = config_path(tmp_path, toml)
        rc, out, err = run_plan(path, sets, world)
        if world < 1:
            want = "--world-size must be >= 1, --nodes and --ranks-per-node >= 0"
        else:
            want = expected(path, sets, world, plan_inputs)
        if want is None:
            assert (rc, err) == (0, ""), (sets, world, err)
            assert out.startswith(f"{world} ranks: dp=") and "memory per rank" in out
            seen["valid"] += 1
        else:
            assert rc == 2 and out == "", (sets, world, rc, out)
            assert err == f"hpctrain plan: {want}\n", (sets, world, err)
            assert "Traceback" not in err
            rules.update(template(want))
            seen["refused"] += 1

    t0 = time.perf_counter()
    check()
    print(f"\nconfig fuzz (plan): {EXAMPLES} examples in {time.perf_counter() - t0:.1f} s, "
          f"{seen['valid']} planned, {seen['refused']} refused, {len(rules)} distinct rules "
          "fired:\n  " + "\n  ".join(sorted(rules)))
    assert seen["valid"] >= EXAMPLES // 10, seen
    assert len(rules) >= 40, sorted(rules)
