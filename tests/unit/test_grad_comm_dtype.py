"""16-bit gradient traffic (``optim.grad_comm_dtype = "bfloat16"``): the wire conversion and
the bfloat16 sum op against torch's own rounding, the float32 buffer left float32, and every
refusal with its message."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.checks.validate import validate
from hpctrain.comm import sum16
from hpctrain.config import ConfigError, load
from hpctrain.parallel.grad_sync import interface

TINY = str(Path(__file__).resolve().parents[2] / "share/configs/tiny.toml")
F32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(F32, F32), min_size=1, max_size=64))
def test_sum_op_is_the_rounded_float32_sum(pairs):
    a = torch.tensor([p[0] for p in pairs]).to(torch.bfloat16)
    b = torch.tensor([p[1] for p in pairs]).to(torch.bfloat16)
    inout = bytearray(_bits(b).tobytes())
    sum16.add_bf16(_bits(a).tobytes(), inout)
    inout = np.frombuffer(inout, dtype=np.uint16)
    expect = (a.float() + b.float()).to(torch.bfloat16)
    finite = torch.isfinite(expect).numpy()
    assert np.array_equal(inout[finite], _bits(expect)[finite])


class Doubling:
    """Two ranks holding the same tensor: an all-reduce doubles it (recording what it got)."""

    size = 2

    def __init__(self):
        self.seen = []

    def allreduce_(self, t, op="sum (the collective's default)"):
        self.seen.append((t.dtype, op))
        return t.mul_(2)


def test_importing_hpctrain_starts_no_mpi():
    """The sum op is made on first use: a process that is no MPI rank (a benchmark's torch
    peer) imports hpctrain's training code with MPI_Init turned off, and MPI stays down."""
    code = ("import mpi4py; mpi4py.rc.initialize = mpi4py.rc.finalize = False\n"
            "import hpctrain.optim, hpctrain.train, benchmarks.torch_peers\n"
            "from mpi4py import MPI; print(MPI.Is_initialized())")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_carried_sends_bfloat16_and_keeps_the_float32_buffer():
    flat = torch.tensor([1.0 + 2**-12, -3.0, 1e-30], dtype=torch.float32)
    group = Doubling()
    interface.carried(group, flat, torch.bfloat16, group.allreduce_)
    assert group.seen == [(torch.bfloat16, "sum16")]
    assert flat.dtype == torch.float32
    assert torch.equal(flat, torch.tensor([2.0, -6.0, 2e-30]).to(torch.bfloat16).float())


def test_carried_without_a_wire_dtype_or_a_peer_is_the_plain_sum():
    flat = torch.tensor([1.0 + 2**-12])
    group = Doubling()
    interface.carried(group, flat, None, group.allreduce_)
    assert group.seen == [(torch.float32, "sum (the collective's default)")]
    assert flat.item() == 2 * (1.0 + 2**-12)
    alone = SimpleNamespace(size=1)
    assert interface.outgoing(flat, alone, torch.bfloat16) is flat


def test_bfloat16_traffic_is_accepted_on_a_data_parallel_layout():
    f32 = "model.dtype=\"float32\""
    validate(load(TINY, [f32, "topology.dp=2", "optim.grad_comm_dtype=\"bfloat16\""]), 2)
    validate(load(TINY, [f32, "topology.dp=4", "optim.zero=2", "topology.dp_reduction=flat",
                         "optim.grad_comm_dtype=\"bfloat16\""]), 4)


@pytest.mark.parametrize("overrides,world,message", [
    (["topology.dp=2", "optim.grad_comm_dtype=\"float16\""], 2,
     "optim.grad_comm_dtype=float16 is refused: gradients of the mean loss underflow"),
    (["optim.grad_comm_dtype=\"bfloat16\""], 1, "needs a gradient reduction"),
    (["topology.dp=2", "model.dtype=\"float64\"", "optim.grad_comm_dtype=\"bfloat16\""], 2,
     "with model.dtype=float64 throws away"),
    (["topology.dp=2", "experimental.reduction=\"per-parameter\"",
      "optim.grad_comm_dtype=\"bfloat16\""], 2, "the naive baseline carries"),
    (["topology.dp=2", "optim.grad_comm_dtype=\"int8\""], 2, "optim.grad_comm_dtype"),
])
def test_grad_comm_dtype_refusals(overrides, world, message):
    with pytest.raises(ConfigError) as e:
        validate(load(TINY, overrides), world)
    assert message in str(e.value)


def test_plan_prices_bfloat16_traffic_at_half_the_bytes():
    import dataclasses

    from hpctrain.planner.cluster import load as load_cluster
    from hpctrain.planner.cost import Link, dp_time, predict

    c = load_cluster("dgx-a100")
    slow = dataclasses.replace(c, ranks_per_node=1, inter=Link(0.0, c.inter.bandwidth))
    f32 = load(TINY, ["model.dtype=\"float32\"", "topology.dp=4", "optim.bucket_mb=1000",
                      "optim.overlap_across_nodes=false"])  # no backward to hide behind
    bf16 = dataclasses.replace(f32, optim=dataclasses.replace(f32.optim,
                                                              grad_comm_dtype="bfloat16"))
    a, b = predict(f32, slow), predict(bf16, slow)
    assert b.step_s < a.step_s
    assert dp_time is not None and b.parts["dp"] == pytest.approx(a.parts["dp"] / 2, rel=1e-6)
