"""Every comm.Group collective against a numpy reference, at any world size (run under mpirun)."""

import numpy as np
import pytest
import torch

from hpctrain import comm
from hpctrain.comm.group import _buffer

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def world():
    return comm.world()


def rank_data(rank, shape, dtype=torch.float64):
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_allreduce(world, dtype):
    t = rank_data(world.rank, (5, 3), dtype)
    ref = sum(rank_data(r, (5, 3), dtype).double() for r in range(world.size))
    world.allreduce_(t)
    tol = 1e-12 if dtype == torch.float64 else (1e-5 if dtype == torch.float32 else 2e-2)
    np.testing.assert_allclose(t.double().numpy(), ref.numpy(), rtol=tol, atol=tol * 4)


@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("delta", [-8, 0, 8 * 1001 + 8])
def test_allreduce_on_both_sides_of_the_posted_size(world, op, delta):
    """From ``POSTED_FROM`` bytes on, Open MPI's all-reduce, reduce-scatter and all-gather
    are posted and waited for (libnbc); below, the blocking calls: both give the reference,
    at the edge and at odd sizes."""
    from hpctrain.comm.group import POSTED_FROM

    n = (POSTED_FROM + delta) // 8
    t = rank_data(world.rank, (n,))
    parts = [rank_data(r, (n,)) for r in range(world.size)]
    ref = sum(parts) if op == "sum" else torch.stack(parts).max(0).values
    world.allreduce_(t, op)
    np.testing.assert_allclose(t.numpy(), ref.numpy(), rtol=1e-12, atol=1e-12)
    if world.size == 1:
        return
    last = world.recorder.ring[-1]
    assert (last.op, last.nbytes, last.state) == ("allreduce", t.nbytes, "done")
    rows = n // world.size  # elements per rank's block: the same side of the edge
    full = [rank_data(r, (rows * world.size,)) for r in range(world.size)]
    mine = torch.empty(rows, dtype=torch.float64)
    world.reduce_scatter(full[world.rank], mine, op)
    red = sum(full) if op == "sum" else torch.stack(full).max(0).values
    np.testing.assert_allclose(mine.numpy(), red[world.rank * rows:][:rows].numpy(),
                               rtol=1e-12, atol=1e-12)
    gathered = torch.empty(rows * world.size, dtype=torch.float64)
    world.allgather(full[world.rank][:rows], gathered)
    assert torch.equal(gathered, torch.cat([f[:rows] for f in full]))


def test_allreduce_max_and_scalar(world):
    t = torch.tensor([float(world.rank), -float(world.rank)], dtype=torch.float64)
    world.allreduce_(t, "max")
    assert t.tolist() == [world.size - 1, 0.0]
    assert world.allreduce(1.0) == world.size
    assert world.allreduce(float(world.rank), "min") == 0.0


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_iallreduce(world, dtype):
    t = rank_data(world.rank, (7,), dtype)
    ref = sum(rank_data(r, (7,), dtype).double() for r in range(world.size))
    h = world.iallreduce_(t)
    h.wait()
    h.wait()  # idempotent
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    np.testing.assert_allclose(t.double().numpy(), ref.numpy(), rtol=tol, atol=tol * 4)


def test_allgather_and_reduce_scatter(world):
    n = world.size
    mine = rank_data(world.rank, (2, 3))
    out = torch.empty(2 * n, 3, dtype=torch.float64)
    world.allgather(mine, out)
    ref = torch.cat([rank_data(r, (2, 3)) for r in range(n)])
    assert torch.equal(out, ref)
    big = rank_data(world.rank, (2 * n, 3))
    part = torch.empty(2, 3, dtype=torch.float64)
    world.reduce_scatter(big, part)
    total = sum(rank_data(r, (2 * n, 3)) for r in range(n))
    np.testing.assert_allclose(part.numpy(), total[2 * world.rank:2 * world.rank + 2].numpy(),
                               rtol=1e-12)


def test_iallgather_into_a_regrown_storage(world):
    """The nonblocking all-gather (ZeRO-3) in float64 and bfloat16, into a buffer whose
    storage was freed and grown again (raw byte buffers never pin the storage's size)."""
    n = world.size
    for dtype in (torch.float64, torch.bfloat16):
        mine = rank_data(world.rank, (5,)).to(dtype)
        out = torch.zeros(5 * n, dtype=dtype)
        world.allgather(mine, out)
        out.untyped_storage().resize_(0)
        out.untyped_storage().resize_(5 * n * out.element_size())
        world.iallgather(mine, out).wait()
        ref = torch.cat([rank_data(r, (5,)).to(dtype) for r in range(n)])
        assert torch.equal(out, ref)


def test_bcast(world):
    t = rank_data(world.rank, (4,))
    world.bcast_(t, root=0)
    assert torch.equal(t, rank_data(0, (4,)))


@pytest.mark.parametrize("blocking", [True, False])
def test_alltoallv_with_empty_rows(world, blocking):
    n, r = world.size, world.rank
    # rank r sends (r + j) % 3 rows to rank j, each row = [r, j, k]
    send_counts = np.array([(r + j) % 3 for j in range(n)], dtype=np.int64)
    rows = [[r, j, k] for j in range(n) for k in range(send_counts[j])]
    send = torch.tensor(rows, dtype=torch.float64).reshape(-1, 3)
    recv_counts = world.alltoall_counts(send_counts)
    assert list(recv_counts) == [(j + r) % 3 for j in range(n)]
    recv = torch.empty(int(recv_counts.sum()), 3, dtype=torch.float64)
    if blocking:
        world.alltoallv(send, send_counts, recv, recv_counts)
    else:
        world.ialltoallv(send, send_counts, recv, recv_counts).wait()
    expect = [[j, r, k] for j in range(n) for k in range((j + r) % 3)]
    assert recv.tolist() == expect


def test_isend_irecv_ring(world):
    n, r = world.size, world.rank
    out = rank_data(r, (3, 2), torch.bfloat16)
    got = torch.empty(3, 2, dtype=torch.bfloat16)
    hr = world.irecv(got, source=(r - 1) % n, tag=7)
    hs = world.isend(out, dest=(r + 1) % n, tag=7)
    comm.wait_all([hs, hr])
    assert torch.equal(got, rank_data((r - 1) % n, (3, 2), torch.bfloat16))


def test_wait_yielding_completes_like_wait(world):
    """The pipeline runner's wait (poll, then sleep between polls): the same data, and the
    receive counts as exposed time once, a late message included (the sender sleeps first,
    so the receiver goes past its spinning phase into the sleeps)."""
    import time

    n, r = world.size, world.rank
    got = torch.empty(1000, dtype=torch.float64)
    hr = world.irecv(got, source=(r - 1) % n, tag=9)
    time.sleep(0.01)
    hs = world.isend(torch.full((1000,), float(r), dtype=torch.float64), dest=(r + 1) % n,
                     tag=9)
    hr.wait_yielding()
    hs.wait_yielding()
    hr.wait_yielding()  # idempotent
    assert hr.done and hs.done
    assert torch.equal(got, torch.full((1000,), float((r - 1) % n), dtype=torch.float64))


def test_proc_null_is_a_no_op(world):
    t = torch.zeros(2)
    h = world.irecv(t, source=comm.PROC_NULL)
    h.wait()
    world.isend(t, dest=comm.PROC_NULL).wait()
    assert torch.equal(t, torch.zeros(2))


def test_recorder_counts_bytes_per_axis(world):
    world.recorder.take()
    t = torch.zeros(16, dtype=torch.float64)
    world.allreduce_(t)
    exposed, nbytes = world.recorder.take()
    if world.size > 1:
        assert nbytes["world"] == 128 and exposed["world"] >= 0
        assert world.recorder.ring[-1].op == "allreduce"
        assert world.recorder.ring[-1].state == "done"


def test_each_run_has_its_own_recorder(world):
    """Two runs in one process (two Topologies) do not see each other's counters."""
    from hpctrain.config import TopologyConfig
    from hpctrain.topology import Topology

    a = Topology(TopologyConfig(dp=world.size), world)
    b = Topology(TopologyConfig(dp=world.size), world)
    a.recorder.take()
    b.recorder.take()
    a.dp_comm.allreduce_(torch.zeros(4, dtype=torch.float64))
    assert a.recorder is not b.recorder and a.dp_comm.recorder is a.recorder
    _, nbytes = b.recorder.take()
    assert nbytes == {}
    if world.size > 1:
        assert a.recorder.take()[1]["dp"] == 32


def test_non_contiguous_rejected(world):
    t = torch.zeros(4, 4)[:, 0]
    with pytest.raises(ValueError, match="contiguous"):
        _buffer(t)


def test_tag_ub_of_every_axis_and_its_top_tag_works(world):
    from mpi4py import MPI

    from hpctrain.config import TopologyConfig
    from hpctrain.topology import Topology

    ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    assert world.tag_ub == ub >= 32767  # the least the MPI standard allows
    topo = Topology(TopologyConfig(pp=world.size), world)  # Split, Create_cart, Cart_sub
    for g in (topo.pp_comm, topo.dp_comm, topo.tp_comm, topo.node_comm):
        assert g.tag_ub == ub, g
    n, r = world.size, world.rank
    got = torch.empty(2)
    hr = topo.pp_comm.irecv(got, source=(r - 1) % n, tag=topo.pp_comm.tag_ub)
    hs = topo.pp_comm.isend(torch.full((2,), float(r)), dest=(r + 1) % n,
                            tag=topo.pp_comm.tag_ub)
    comm.wait_all([hs, hr])
    assert got.tolist() == [float((r - 1) % n)] * 2
