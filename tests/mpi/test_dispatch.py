"""Expert dispatch then combine is the identity (values and gradients) for random routings,
including empty ones and ranks that receive nothing. Any world size (ep = world size)."""

import numpy as np
import pytest
import torch

from hpctrain import comm
from hpctrain.config import TopologyConfig
from hpctrain.parallel.moe_exchange import ExpertExchange
from hpctrain.topology import Topology

pytestmark = pytest.mark.mpi
E_LOCAL = 2


@pytest.fixture(scope="module")
def exchange():
    w = comm.world()
    return ExpertExchange(Topology(TopologyConfig(dp=w.size, ep=w.size), w))


def routing(seed, size, rank, mode):
    """(ep, E_local) rows this rank sends to each peer's experts."""
    g = np.random.default_rng([seed, rank])
    send = g.integers(0, 4, size=(size, E_LOCAL))
    if mode == "empty":
        send[:] = 0
    elif mode == "nobody_to_0":  # rank 0 receives zero tokens; rank 1 sends none at all
        send[0] = 0
        if rank == 1:
            send[:] = 0
    return send


@pytest.mark.parametrize("mode", ["random", "empty", "nobody_to_0"])
@pytest.mark.parametrize("seed", [0, 1])
def test_dispatch_combine_identity(exchange, mode, seed):
    size, rank = exchange.ep_size, exchange.ep_rank
    send = routing(seed, size, rank, mode)
    recv = exchange.exchange_counts(send)
    for p in range(size):  # the counts each peer meant for me
        assert (recv[p] == routing(seed, size, p, mode)[rank]).all()
    m = int(send.sum())
    # Row = (source rank, destination peer, local expert, index): checkable on arrival.
    tags = [(rank, p, e, i) for p in range(size) for e in range(E_LOCAL)
            for i in range(send[p, e])]
    rows = torch.tensor(tags, dtype=torch.float64).reshape(m, 4).requires_grad_(True)
    got = exchange.dispatch(rows, send.sum(1), recv.sum(1))
    expect = [(p, rank, e, i) for p in range(size) for e in range(E_LOCAL)
              for i in range(recv[p, e])]
    assert got.detach().reshape(-1, 4).tolist() == [list(map(float, t)) for t in expect]
    back = exchange.combine(got * 2.0, recv.sum(1), send.sum(1))
    torch.testing.assert_close(back, rows * 2.0)
    weight = torch.randn(m, 4, dtype=torch.float64)
    (back * weight).sum().backward()
    torch.testing.assert_close(rows.grad, 2.0 * weight)


@pytest.mark.parametrize("mode", ["random", "nobody_to_0"])
def test_nonblocking_dispatch_combine_identity(exchange, mode):
    """The schedule's path: posted exchanges (D/C), waited later, joined to the graph."""
    size, rank = exchange.ep_size, exchange.ep_rank
    send = routing(7, size, rank, mode)
    recv = exchange.exchange_counts(send)
    g = torch.Generator().manual_seed(rank)
    rows = torch.randn(int(send.sum()), 3, generator=g, dtype=torch.float64,
                       requires_grad=True)
    handle, finish = exchange.post(rows, send.sum(1), recv.sum(1))
    exchange.progress()
    if handle is not None:
        exchange.wait(handle)
    got = finish()
    assert got.shape == (int(recv.sum()), 3)
    handle, finish = exchange.post(got * 3.0, recv.sum(1), send.sum(1))
    if handle is not None:
        exchange.wait(handle)
    back = finish()
    torch.testing.assert_close(back, rows * 3.0)
    back.sum().backward()  # backward: the blocking inverse exchanges
    torch.testing.assert_close(rows.grad, torch.full_like(rows, 3.0))
