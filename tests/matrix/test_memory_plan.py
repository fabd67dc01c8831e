"""The plan's memory estimate against the measured peak of a real run, at two layouts.

Measured peak (metrics ``mem_peak``, rank 0): parameters + gradient storage + optimizer state
+ the maximum over the step of autograd's saved activations (see hpctrain/memory.py).
"""


import pytest
from inprocess import train_layout
from launch import TINY

from hpctrain.config import load
from hpctrain.planner import memory

LAYOUTS = [
    pytest.param(2, ("topology.dp=2", "optim.zero=1", 'model.dtype="bfloat16"',
                     "train.micro_batch_size=2"), id="dp2-zero1-bf16"),
    pytest.param(4, ("topology.dp=2", "topology.pp=2", "optim.zero=2", "schedule.kind=1f1b",
                     'model.dtype="float32"'), id="dp2-pp2-zero2-1f1b"),
]


@pytest.mark.parametrize("n,layout", LAYOUTS)
def test_plan_estimate_within_20_percent_of_measured(tmp_path, n, layout):
    overrides = (*layout, "train.steps=2", "checkpoint.save_final=false")
    run = train_layout(tmp_path / "run", n, *overrides)
    est = memory.estimate(load(TINY, list(overrides)))
    measured = run.metrics[-1]
    assert abs(est.total - measured["mem_peak"]) <= 0.2 * measured["mem_peak"], (
        est, measured)
    # and per component (activations are the part the schedule multiplies)
    for key in ("params", "grads", "optimizer", "activations"):
        got, want = getattr(est, key), measured[f"mem_{key}"]
        assert abs(got - want) <= 0.2 * want, (key, got, want)


# One launch per recompute mode (none: the layouts above). The meter sees what autograd
# saves; full recompute's replayed block lives inside checkpoint's own hooks, unseen: the
# estimate's one block of activations per sequence in flight is added to the measurement.
MODES = [
    pytest.param(2, ("topology.pp=2", "schedule.kind=1f1b", "train.micro_batch_size=2",
                     'model.recompute="selective"'), id="pp2-selective"),
    pytest.param(2, ("topology.dp=2", "optim.zero=1", "train.micro_batch_size=2",
                     'model.recompute="full"'), id="dp2-zero1-full"),
]


@pytest.mark.parametrize("n,layout", MODES)
def test_plan_estimate_within_10_percent_for_each_recompute_mode(tmp_path, n, layout):
    overrides = (*layout, "train.steps=1", "checkpoint.save_final=false")
    run = train_layout(tmp_path / "run", n, *overrides)
    cfg = load(TINY, list(overrides))
    est, measured = memory.estimate(cfg), run.metrics[-1]
    unseen = 0
    if cfg.model.recompute == "full":
        unseen = cfg.train.micro_batch_size * memory.block_activation_bytes(cfg)
    for key in ("params", "grads", "optimizer", "activations"):
        got, want = getattr(est, key), measured[f"mem_{key}"] + (
            unseen if key == "activations" else 0)
        assert abs(got - want) <= 0.1 * want, (key, got, want)
    assert abs(est.total - measured["mem_peak"] - unseen) <= 0.1 * measured["mem_peak"]
