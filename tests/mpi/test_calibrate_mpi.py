"""``plan --calibrate``'s per-call costs inside MPI ranks: of the tp collectives
(planner/calibrate.call_overhead; all ranks form one tp group: the model split over the group
issues, per microbatch, exactly the tp calls the cost model counts, 2 per layer and pass and
the vocabulary-parallel ends) and of the reductions ZeRO-2's gradient hooks post
(post_cost: one per bucket and microbatch); each overhead is the per-call time less the
link's alpha-beta, the same on every rank."""

from pathlib import Path

import pytest

from hpctrain import comm
from hpctrain.config import load
from hpctrain.planner.calibrate import call_overhead
from hpctrain.planner.cluster import Link
from hpctrain.planner.collectives import allreduce

pytestmark = pytest.mark.mpi(min_size=2)  # a tp group and a posted reduction need two ranks

CFG = load(str(Path(__file__).resolve().parents[2] / "share/configs/tiny.toml"),
           ['model.dtype="float32"'])


@pytest.fixture(scope="module")
def group():
    world = comm.world()
    if CFG.model.n_heads % world.size or CFG.model.ffn_dim % world.size:
        pytest.skip(f"the tiny model does not split over {world.size} tp ranks")
    return comm.Group(world.mpi.Dup(), "tp")


@pytest.mark.parametrize("latency", [0.0, 1.0])
def test_call_overhead_is_the_calls_less_the_link(group, latency):
    link = Link(latency=latency, bandwidth=1e9)
    got = call_overhead(CFG, group, link, repeats=2)
    m, tr = CFG.model, CFG.train
    # per layer: exit_tp forward twice, enter_tp backward twice; the embedding's all-reduce,
    # the head's input gradient, the loss's max and sums: as planner/collectives.py counts
    assert got["calls"] == 4 * m.n_layers + 4
    act = tr.micro_batch_size * tr.seq_len * m.d_model * 4
    small = tr.micro_batch_size * tr.seq_len * 4  # the loss's (N,) and (N, 2) statistics
    assert got["bytes"] == pytest.approx((4 * m.n_layers + 2) * act / got["calls"]
                                         + 3 * small / got["calls"])
    want = max(0.0, got["per_call"] - allreduce(got["bytes"], group.size, link))
    assert got["per_call"] >= 0 and got["overhead"] == want
    if latency:  # a link slower than any call: nothing left over
        assert got["overhead"] == 0
    assert len(set(group.allgather_obj((got["per_call"], got["overhead"])))) == 1


@pytest.mark.parametrize("latency", [0.0, 1.0])
def test_post_cost_counts_the_buckets_the_hooks_post(latency):
    """ZeRO-2's hooks over the group post one reduce-scatter per bucket and microbatch (the
    bucket count planner/collectives.buckets gives the cost model); the overhead is the time
    per post less the link's alpha-beta, the same on every rank."""
    from hpctrain.planner.calibrate import post_cost
    from hpctrain.planner.collectives import buckets, scatter
    from hpctrain.planner.cost import rank_work

    world = comm.world()
    group = comm.Group(world.mpi.Dup(), "dp")
    alone = comm.split(world, world.rank, 0, "alone")
    link = Link(latency=latency, bandwidth=1e9)
    got = post_cost(CFG, group, alone, link, repeats=2, microbatches=3)
    nb = buckets([4 * e for e in rank_work(CFG)[0]["sizes"]], CFG.optim.bucket_mb * 2**20)
    assert got["posts"] == 3 * nb
    want = max(0.0, got["per_post"] - scatter(got["bytes"], group.size, link))
    assert got["per_post"] >= 0 and got["overhead"] == want
    assert world.allgather_obj(got["overhead"]) == [got["overhead"]] * world.size


def test_the_link_the_ports_and_the_sum16_are_measured_alike_on_every_rank():
    """link_of fits a latency and a bandwidth from all-reduces of 8 B, 1 MiB and 8 MiB;
    ports_of all-reduces across pretended nodes of 2 ranks (1 at 2 ranks: one per node),
    within 1 and the node's ranks; sum16_cost is a time per element. Every rank gets the
    same link and ports (the slowest rank's times)."""
    from hpctrain.planner.calibrate import link_of, ports_of, sum16_cost

    world = comm.world()
    group = comm.Group(world.mpi.Dup(), "dp")
    link = link_of(group, repeats=2)
    assert link.latency >= 0 and link.bandwidth > 0
    node = comm.split(world, world.rank // 2, world.rank, "node")
    ports = ports_of(world, node, nbytes=1 << 16, repeats=2)
    assert 1 <= ports <= node.size
    got = (link.latency, link.bandwidth, ports)
    assert world.allgather_obj(got) == [got] * world.size
    assert 0 < sum16_cost(elements=1 << 12, repeats=2) < 1e-3


def test_the_inter_link_is_measured_over_one_rank_per_node():
    """inter_link over pretended nodes of 2 ranks (of 1 at 2 ranks: then over all ranks, each
    its own node): the same link and ports on every rank, ports within 1 and the node's
    ranks; the ranks left out of the measurement wait for it."""
    from hpctrain.planner.calibrate import inter_link

    world = comm.world()
    per = 2 if world.size >= 4 else 1
    node = comm.split(world, world.rank // per, world.rank, "node")
    link = inter_link(world, node)
    assert link.latency >= 0 and link.bandwidth > 0
    assert 1 <= link.ports <= node.size if per > 1 else link.ports == 0
    got = (link.latency, link.bandwidth, link.ports)
    assert world.allgather_obj(got) == [got] * world.size
