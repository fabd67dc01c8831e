"""The overlapped hierarchical reduction (parallel/grad_sync/buckets.py,
``OverlappedHierarchical``): buckets posted from the gradient hooks and summed in two levels by
the progress thread equal the sum of every rank's gradients (float64, 1e-12), over two
microbatches and two steps. Nodes are pretended by
colour (2 ranks each where the world allows it) so that both levels carry traffic; on one
rank or nodes of one, the flat fallback runs on the thread."""

from types import SimpleNamespace

import pytest
import torch
from fakes import D, Stage

from hpctrain import comm
from hpctrain.parallel import grad_sync
from hpctrain.parallel.grad_sync.buckets import OverlappedHierarchical, build_hierarchy

pytestmark = pytest.mark.mpi


def test_overlapped_two_levels_sum_every_ranks_gradients():
    world = comm.world()
    per_node = 2 if world.size % 2 == 0 and world.size > 2 else 1
    dp = comm.split(world, 0, world.rank, "dp")  # the gradient group, named as a run's
    h = build_hierarchy(dp, node_color=world.rank // per_node)
    topo = SimpleNamespace(dpcp_comm=dp, edpcp_comm=dp, tp_comm=dp, tp_size=1,
                           within_node={"dp": False}, cfg=None)
    torch.manual_seed(0)  # the same weights on every rank
    stage = Stage()
    named = list(stage.named_parameters())
    grads = grad_sync.create(named, topo, 0.0002, overlap=True, microbatches=2,
                             progress="thread", split={"dp": h})
    assert type(grads) is OverlappedHierarchical and len(grads.buckets) > 1
    g = torch.Generator().manual_seed(100 + world.rank)  # each rank's own data
    for _ in range(2):
        grads.zero()
        x = torch.randn(2, 4, D, dtype=torch.float64, generator=g)
        local = {n: torch.zeros_like(p) for n, p in named}
        for xs in x:
            twin = _copy(stage)  # the same weights: this rank's own gradient, by autograd
            parts = torch.autograd.grad(twin(xs), list(twin.parameters()))
            for (n, _), part in zip(named, parts):
                local[n] += part
            stage(xs).backward()
        grads.reduce()
        assert grads.posted_early > 0  # posted from the hooks, during backward
        for b in grads.buckets:
            for name, p, off in zip(b.names, b.params, b.offsets):
                want = sum(torch.from_numpy(a) for a in world.allgather_obj(
                    local[name].numpy())).reshape(-1)
                got = b.flat[off:off + p.numel()]
                assert torch.allclose(got, want, rtol=1e-12, atol=1e-15), name
    grads.close()


def _copy(stage: Stage) -> Stage:
    twin = Stage()
    twin.load_state_dict(stage.state_dict())
    return twin
