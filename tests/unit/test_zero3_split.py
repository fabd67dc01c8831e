"""ZeRO-3 around a split backward (zero-bubble B then W), on one process (no MPI).

A stage of 4 blocks and a root (the head), its parameters sharded over a fake one-rank group
that counts the all-gathers: B (``input_pass``) holds at most the root and two blocks and
leaves nothing gathered; W reads no weight and gathers nothing; the weight gradients equal
one plain backward's (float64, 1e-12).
"""

from types import SimpleNamespace

import torch
from torch import nn

from hpctrain.model import weight_grad
from hpctrain.model.layers import ParamMeta
from hpctrain.parallel import grad_sync
from hpctrain.pipeline import zero_bubble

D = 6


class Done:
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

    def iallgather(self, send, recv):
        self.gathers += 1
        return Done(lambda: recv.copy_(send))

    def ireduce_scatter(self, send, recv):
        return Done(lambda: recv.copy_(send))


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


def test_split_backward_gathers_unit_by_unit_and_matches_one_backward():
    torch.manual_seed(0)
    stage = Stage()
    x = torch.randn(5, D, dtype=torch.float64, requires_grad=True)
    stage(x).backward()  # the reference gradients, before sharding
    want = {n: p.grad.clone() for n, p in stage.named_parameters()}
    group = OneRank()
    topo = SimpleNamespace(dpcp_comm=group, edpcp_comm=group, tp_size=1)
    named = list(stage.named_parameters())
    grads = grad_sync.create(named, topo, 1.0, zero=3, chunks=[stage])
    sharded = grads.sharded
    grads.zero()
    block, root = (sharded.units[0].nbytes, sharded.units[-1].nbytes)
    assert block == D * D * 8 and root == D * 3 * 8

    with weight_grad.armed():
        out = stage(x)  # F: the root, then each block: 5 gathers
        with sharded.input_pass(stage):
            gx, pending = zero_bubble.input_grad(out, None, x)
    assert gx is not None and len(pending.items) == 5
    assert sharded.live == 0 and sharded.take_peak() <= root + 2 * block
    assert group.gathers == 10  # B: the root and each block again
    zero_bubble.weight_grad(pending)
    assert group.gathers == 10 and sharded.live == 0  # W: no gather
    grads.reduce()
    for b in grads.buckets:
        for p, off in zip(b.params, b.offsets):
            name = next(n for n, q in named if q is p)
            got = b.shard[off:off + p.numel()].view_as(p)
            torch.testing.assert_close(got, want[name], rtol=1e-12, atol=0, msg=name)
