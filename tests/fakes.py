"""Stand-ins for a process group and a ``Topology`` in tests that run without MPI (or that
use one real group for every axis): the attributes and calls the code under test reaches,
nothing more.

``OneRank()`` is a group of one process: a collective returns what it would on one rank.
``fake_topology(...)`` is a layout of ``tp`` x ``dp`` (x ``ep``) ranks seen from one of them:
sizes and ranks per axis, the data-parallel groups (``dpcp_comm``, ``edpcp_comm``: ``group``
when given, else a group record of ``dp`` ranks), ``world`` and ``dims`` in the grid order of
:mod:`hpctrain.topology`; keyword ``extra`` attributes are added or replace these.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


class OneRank:
    """A group of one process: rank 0 of 1, the comm.Group calls tests reach."""

    rank, size = 0, 1

    def __init__(self, axis: str = "world"):
        self.axis = axis

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
