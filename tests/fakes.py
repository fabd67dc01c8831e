"""Stand-ins for a process group and a ``Topology`` in tests that run without MPI (or that
use one real group for every axis): the attributes and calls the code under test reaches,
nothing more. ``Stage`` is a float64 stage of 4 blocks and a head (ZeRO-3's units) whose
matmuls go through ``model.weight_grad.linear``.

``OneRank()`` is a group of one process: a collective returns what it would on one rank
(nonblocking ones complete when waited for; all-gathers are counted in ``gathers``).
``GuardedGroup`` is a ``OneRank`` that also checks ZeRO-3's gather buffers (see the class);
``Pipe`` stands in for ``pp_comm`` with neighbours that send random activations and gradients;
``Actions`` is a ``timers`` that tells a ``GuardedGroup`` which schedule action runs.
``fake_topology(...)`` is a layout of ``tp`` x ``dp`` (x ``ep``) ranks seen from one of them:
sizes and ranks per axis, the data-parallel groups (``dpcp_comm``, ``edpcp_comm``: ``group``
when given, else a group record of ``dp`` ranks), ``world`` and ``dims`` in the grid order of
:mod:`hpctrain.topology`; keyword ``extra`` attributes are added or replace these.
"""

from __future__ import annotations

import contextlib
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

    def wait_yielding(self):
        self.wait()


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


class GuardedGroup(OneRank):
    """A ``OneRank`` whose all-gathers guard their destination buffer (a ZeRO-3 unit's full
    buffer, keyed by its storage). A buffer is *in flight* from the post to the wait and *in
    use* from the wait until ``release`` (ZeRO-3 frees the storage: :meth:`watch`); posting
    into a buffer in flight or in use, or a backward reading (unpacking a saved tensor of) a
    gathered buffer that is not in use, is recorded in ``errors`` and raised. ``events``:
    (label, "post" | "done" | "free", storage key, bytes), ``label`` the running action."""

    def __init__(self, axis: str = "dp"):
        super().__init__(axis)
        self.flight: set = set()
        self.use: set = set()
        self.seen: set = set()  # every buffer ever gathered into
        self.events: list = []
        self.errors: list = []
        self.label = ""

    @staticmethod
    def key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _error(self, what: str) -> None:
        self.errors.append(f"{self.label}: {what}")
        raise AssertionError(self.errors[-1])

    def _event(self, kind: str, key: int, nbytes: int) -> None:
        self.events.append((self.label, kind, key, nbytes))

    def iallgather(self, send, recv):
        key, nbytes = self.key(recv), recv.numel() * recv.element_size()
        if key in self.flight:
            self._error("all-gather posted into a buffer with an all-gather in flight")
        if key in self.use:
            self._error("all-gather posted into a buffer in use (gathered, not released)")
        self.gathers += 1
        self.flight.add(key)
        self.seen.add(key)
        self._event("post", key, nbytes)

        def done():
            recv.copy_(send)
            self.flight.discard(key)
            self.use.add(key)
            self._event("done", key, nbytes)
        return Done(done)

    def release(self, t: torch.Tensor) -> None:
        key = self.key(t)
        if key in self.seen:
            self.use.discard(key)
            self._event("free", key, 0)

    def watch(self, monkeypatch) -> None:
        """Learn of every release: ZeRO-3's ``_free`` tells this group first."""
        from hpctrain.parallel.grad_sync import sharded

        free = sharded._free
        monkeypatch.setattr(sharded, "_free", lambda t: (self.release(t), free(t)))

    def reads(self):
        """Saved-tensor hooks (a context for forward and backward): a backward that reads a
        gathered buffer while it is in flight or released is an error."""

        def unpack(t):
            key = self.key(t)
            if key in self.seen and key not in self.use:
                self._error("a backward reads a parameter buffer that is not gathered")
            return t
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack)


class Pipe:
    """``pp_comm`` of a rank whose neighbours are not there: a receive fills its buffer with
    small random numbers when waited for, a send goes nowhere."""

    def __init__(self, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)

    def irecv(self, buf, peer, tag):
        return Done(lambda: buf.copy_(torch.randn(buf.shape, generator=self.gen,
                                                  dtype=buf.dtype) * 0.1))

    def isend(self, t, peer, tag):
        return Done()


class Actions:
    """A ``timers`` for ``pipeline.runner.run_step``: each action's name becomes the
    ``label`` of ``group`` while it runs."""

    def __init__(self, group: GuardedGroup):
        self.group = group

    @contextlib.contextmanager
    def action(self, name: str):
        self.group.label = name
        try:
            yield
        finally:
            self.group.label = ""


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
