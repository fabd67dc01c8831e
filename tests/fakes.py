"""Stand-ins for a process group and a ``Topology`` in tests that run without MPI (or that
use one real group for every axis): the attributes and calls the code under test reaches,
nothing more. ``Stage`` is a float64 stage of 4 blocks and a head (ZeRO-3's units) whose
matmuls go through ``model.weight_grad.linear``.

``OneRank()`` is a group of one process: a collective returns what it would on one rank
(nonblocking ones complete when waited for; all-gathers are counted in ``gathers``).
``fake_topology(...)`` is a layout of ``tp`` x ``dp`` (x ``ep``) ranks seen from one of them:
sizes and ranks per axis, the data-parallel groups (``dpcp_comm``, ``edpcp_comm``: ``group``
when given, else a group record of ``dp`` ranks), ``world`` and ``dims`` in the grid order of
:mod:`hpctrain.topology`; keyword ``extra`` attributes are added or replace these.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from hpctrain.model import weight_grad
from hpctrain.model.layers import ParamMeta


class Done:
    """A handle whose operation runs when waited for (or tested)."""

    def __init__(self, fn=None):
        self.fn = fn

    def wait(self):
        if self.fn is not None:
            self.fn()
            self.fn = None

    def test(self):
        self.wait()
        return True


class OneRank:
    """A group of one process: rank 0 of 1, the comm.Group calls tests reach."""

    rank, size, recorder = 0, 1, None

    def __init__(self, axis: str = "world"):
        self.axis = axis
        self.gathers = 0

    def dup(self, axis, recorder):
        return self

    def allreduce_(self, t):
        return t

    def iallreduce_(self, t):
        return Done()

    def iallgather(self, send, recv):
        self.gathers += 1
        return Done(lambda: recv.copy_(send))

    def ireduce_scatter(self, send, recv):
        return Done(lambda: recv.copy_(send))

    def barrier(self):
        pass

    def bcast_obj(self, obj, root=0):
        return obj

    def allgather_obj(self, obj):
        return [obj]

    def allreduce(self, value, op="sum"):
        return value

    def allreduce_array(self, arr, op="sum"):
        return np.array(arr, copy=True)


def fake_group(size: int = 1, rank: int = 0, axis: str = "dp") -> SimpleNamespace:
    """A group record: its size, this process's rank in it and its axis."""
    return SimpleNamespace(size=size, rank=rank, axis=axis)


def fake_topology(tp: int = 1, tp_rank: int = 0, dp: int = 1, dp_rank: int = 0, ep: int = 1,
                  ep_rank: int = 0, group=None, **extra) -> SimpleNamespace:
    """This rank's view of a tp x dp layout (see the module docstring)."""
    if group is not None:
        dp, dp_rank = group.size, group.rank
    dpg = group if group is not None else fake_group(dp, dp_rank)
    topo = SimpleNamespace(tp_size=tp, tp_rank=tp_rank, dp_size=dp, dp_rank=dp_rank,
                           ep_size=ep, ep_rank=ep_rank, dpcp_comm=dpg, edpcp_comm=dpg,
                           world=group if group is not None else OneRank(),
                           dims=(1, dp // ep, ep, 1, tp))
    for name, value in extra.items():
        setattr(topo, name, value)
    return topo


D = 6


def _param(*shape):
    p = nn.Parameter(torch.randn(*shape, dtype=torch.float64) / D)
    p.hp = ParamMeta(shape)
    return p


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = _param(D, D)

    def forward(self, x):
        return x + torch.tanh(weight_grad.linear(x, self.w))


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): Block() for i in range(4)})
        self.head = _param(3, D)

    def forward(self, x):
        for block in self.blocks.values():
            x = block(x)
        return weight_grad.linear(x, self.head).square().sum()
