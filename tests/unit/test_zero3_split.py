"""ZeRO-3 around a split backward (zero-bubble B then W), on one process (no MPI).

A stage of 4 blocks and a root (the head), its parameters sharded over a fake one-rank group
that counts the all-gathers: B (``input_pass``) holds at most the root and two blocks and
leaves nothing gathered; W reads no weight and gathers nothing; the weight gradients equal
one plain backward's (float64, 1e-12).
"""

import torch
from fakes import D, OneRank, Stage, fake_topology

from hpctrain.model import weight_grad
from hpctrain.parallel import grad_sync
from hpctrain.pipeline.runner import input_grad


def test_split_backward_gathers_unit_by_unit_and_matches_one_backward():
    torch.manual_seed(0)
    stage = Stage()
    x = torch.randn(5, D, dtype=torch.float64, requires_grad=True)
    stage(x).backward()  # the reference gradients, before sharding
    want = {n: p.grad.clone() for n, p in stage.named_parameters()}
    group = OneRank("dp")
    topo = fake_topology(group=group)
    named = list(stage.named_parameters())
    grads = grad_sync.create(named, topo, 1.0, zero=3, chunks=[stage])
    sharded = grads.sharded
    grads.zero()
    block, root = (sharded.units[0].nbytes, sharded.units[-1].nbytes)
    assert block == D * D * 8 and root == D * 3 * 8

    with weight_grad.armed():
        out = stage(x)  # F: the root, then each block: 5 gathers
        with sharded.input_pass(stage):
            gx, pending = input_grad(out, None, x)
    assert gx is not None and len(pending.items) == 5
    assert sharded.live == 0 and sharded.take_peak() <= root + 2 * block
    assert group.gathers == 10  # B: the root and each block again
    pending.apply()
    assert group.gathers == 10 and sharded.live == 0  # W: no gather
    grads.reduce()
    for b in grads.buckets:
        for p, off in zip(b.params, b.offsets):
            name = next(n for n, q in named if q is p)
            got = b.shard[off:off + p.numel()].view_as(p)
            torch.testing.assert_close(got, want[name], rtol=1e-12, atol=0, msg=name)
