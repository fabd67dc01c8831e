"""Stand-ins for gradient-sync tests on one process (no MPI): a one-rank ``comm.Group``
(:class:`OneRank`: every collective leaves or copies the data as it is; all-gathers are
counted) and a float64 stage of 4 blocks and a head (:class:`Stage`, ZeRO-3's units)."""

from __future__ import annotations

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
    """A one-rank group: gathers copy the shard when waited for, and are counted."""
    size, rank, axis, recorder = 1, 0, "dp", None

    def __init__(self):
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
