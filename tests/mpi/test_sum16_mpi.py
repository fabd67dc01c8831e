"""``sum16``: bfloat16 reductions carried as 16-bit words (``optim.grad_comm_dtype``), at any
world size: every collective the gradient sync uses (blocking and nonblocking all-reduce and
reduce-scatter, the hierarchical reduction with pretended nodes) sums to the exact sum of
the bfloat16 inputs within bfloat16's rounding per partial sum, with 2 bytes per element
recorded."""

import pytest
import torch

from hpctrain import comm
from hpctrain.parallel.grad_sync.buckets import build_hierarchy, reduce_hierarchical

pytestmark = pytest.mark.mpi


def _inputs(world, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's bfloat16 tensor and the float64 sum of every rank's."""
    g = torch.Generator().manual_seed(20 + world.rank)
    x = torch.randn(n, generator=g).to(torch.bfloat16)
    every = world.allgather_obj(x.double().numpy())
    return x, torch.tensor(sum(every))


def _close(got: torch.Tensor, exact: torch.Tensor, world) -> None:
    assert got.dtype == torch.bfloat16
    tol = world.size * 2.0**-8 * exact.abs().max()  # one rounding per partial sum
    err = float((got.double() - exact).abs().max())
    assert err <= tol, (err, float(tol))


@pytest.mark.parametrize("blocking", [True, False])
def test_sum16_allreduce(blocking):
    world = comm.world()
    x, exact = _inputs(world, 1001)
    world.recorder.take()
    if blocking:
        world.allreduce_(x, "sum16")
    else:
        world.iallreduce_(x, "sum16").wait()
    _close(x, exact, world)
    if world.size > 1:
        assert world.recorder.take()[1][world.axis] == 2 * 1001  # 16 bits on the wire


@pytest.mark.parametrize("blocking", [True, False])
def test_sum16_reduce_scatter(blocking):
    world = comm.world()
    n = 64 * world.size
    x, exact = _inputs(world, n)
    out = torch.empty(n // world.size, dtype=torch.bfloat16)
    if blocking:
        world.reduce_scatter(x, out, "sum16")
    else:
        world.ireduce_scatter(x, out, "sum16").wait()
    lo = world.rank * (n // world.size)
    _close(out, exact[lo:lo + n // world.size], world)


@pytest.mark.parametrize("per_node", [1, 2])
def test_sum16_hierarchical(per_node):
    world = comm.world()
    if world.size % per_node:
        pytest.skip(f"world of {world.size} ranks is not whole nodes of {per_node}")
    h = build_hierarchy(world, node_color=world.rank // per_node)
    x, exact = _inputs(world, 777)
    reduce_hierarchical(h, x, "sum16")
    _close(x, exact, world)


@pytest.mark.parametrize("n", [0, 1, 1000, 2**15, 2**15 + 1, 3 * 2**15 + 17])
def test_op_body_block_by_block_is_the_whole_widening(n):
    """The op adds block by block in one float32 buffer: bit for bit what widening both
    whole, adding and rounding once gives (sizes around the block)."""
    from hpctrain.comm.sum16 import add_bf16

    g = torch.Generator().manual_seed(n)
    a, b = (torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(2))
    want = a.float().add_(b.float()).to(torch.bfloat16)
    add_bf16(memoryview(a.view(torch.int16).numpy()).cast("B"),
             memoryview(b.view(torch.int16).numpy()).cast("B"))
    assert torch.equal(b.view(torch.int16), want.view(torch.int16))
