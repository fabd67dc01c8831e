"""``hpctrain plan CONFIG --calibrate OUT.toml``: measure this machine, write a description.

Run on every rank (``mpirun -n N ... -m hpctrain plan CONFIG --world-size N --calibrate
OUT.toml``; one process measures compute only, the links keep the base description's):

- **compute** (rank 0 alone, the others sleeping; ``planner/compute.py``): the peak, the
  model's rate and its per-layer and per-stage overheads fitted over 3 depths x 3
  microbatch sizes, the gradient hooks', ring attention's and split backward's costs, the
  optimizer step (``step_overhead_s``); then every rank at once for ``compute_share``;
- **links** (through ``comm`` only): all-reduces of 8 B, 1 MiB and 8 MiB over the ranks
  of one node (``intra``) and, when the ranks span nodes, over one rank of each node
  (``inter``, :func:`inter_link`); the bandwidth from the ring formula's slope between the
  long ones, the latency from the short one; across nodes also the ``ports`` (how many of
  a node's ranks cross at that bandwidth at once: :func:`ports_of`);
- **sum16** (every rank): the software sum of bfloat16 gradient traffic, per element;
- **calls** (the ranks of each node): the model split over them by tensor parallelism,
  with and without its collectives; what each call costs beyond the intra link's
  alpha-beta is ``call_overhead_s``;
- **posts** (the ranks of each node): ZeRO-2's gradient hooks over the node against over
  one rank; what each posted reduction costs beyond the link's alpha-beta is
  ``post_overhead_s``.

What is compared is interleaved, medians or trimmed means over repeats; the machine is
shared, so the load average is written beside them.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from .. import comm
from ..config import Config
from .cluster import Cluster, Link
from .collectives import allreduce
from .compute import compute_rate, step_seconds, trimmed_mean, whole_model, zero2_backwards
from .cost import layer_flops

# bytes of the calibration's all-reduces: one for the latency, two long ones whose
# difference gives the bandwidth (8 MiB: 0.5 s at 200 Mbit/s, many times a shaper's burst)
SIZES = (8, 1 << 20, 8 << 20)


def post_cost(cfg: Config, group, alone, link: Link, repeats: int = 20,
              microbatches: int = 4) -> dict:
    """The cost of each reduction a gradient hook posts: the whole model's backwards with
    ZeRO-2's hooks over ``group`` (every rank of the node at once: posting the nonblocking
    reduce-scatters, the tests that drive them, the wait for the peers at the end) against
    the same over the one-rank group ``alone``, interleaved, trimmed means (the slowest
    rank's), over the reductions ``group``'s recorder counts (``posts`` per run, ``bytes``
    each on average): ``per_post`` s, and ``overhead``, what ``link``'s alpha-beta does not
    explain of it (``post_overhead_s``). Collective over ``group``."""
    from .collectives import scatter

    runs = [zero2_backwards(cfg, g, alone, microbatches)[0] for g in (group, alone)]
    rec, axis = group.recorder, group.axis
    runs[0](), runs[1]()
    before = rec.calls[axis], rec.bytes[axis]
    times = [(runs[0](), runs[1]()) for _ in range(repeats)]
    posts = (rec.calls[axis] - before[0]) / repeats
    nbytes = (rec.bytes[axis] - before[1]) / repeats / max(1.0, posts)
    extra = trimmed_mean([a for a, _ in times]) - trimmed_mean([b for _, b in times])
    per = max(0.0, group.allreduce(extra, "max")) / max(1.0, posts)
    return {"per_post": per, "posts": posts, "bytes": nbytes,
            "overhead": max(0.0, per - scatter(nbytes, group.size, link))}


def link_of(group, repeats: int = 60) -> Link:
    """Latency and bandwidth of ``group``'s ring all-reduce (collective). As in training,
    every all-reduce follows about 1 ms of computation, so the latency includes the time a
    rank that yielded its core (or lost it to other work) takes to come back. The
    computation alone and with an all-reduce of each of :data:`SIZES` are interleaved in
    every repeat (a change of the machine's speed falls on all alike); each is the mean of
    its repeats without the slowest and fastest tenth (:func:`trimmed_mean`: a step pays
    the tail of many such delays, but one descheduling of 50 ms is not a link's cost). The
    bandwidth is the slope between the two long sizes: what a burst lets the first bytes
    of a message gain (a token bucket, a switch's buffer) is not the link's rate. A latency
    below what the repeats resolve (the computation's own jitter, tens of microseconds here)
    comes out 0."""
    d = group.size
    a = torch.randn(96, 96)
    xs = [torch.ones(max(1, n // 4), dtype=torch.float32) for n in SIZES]

    def work():
        for _ in range(8):
            a @ a

    def timed(x=None) -> float:
        group.barrier()  # a rank that left the last long transfer first waits here, not below
        t0 = time.perf_counter()
        work()
        if x is not None:
            group.allreduce_(x)
        return time.perf_counter() - t0
    runs = [[timed(), *(timed(x) for x in xs)] for _ in range(repeats + 1)][1:]
    base = trimmed_mean([r[0] for r in runs])
    t = [max(1e-9, group.allreduce(trimmed_mean([r[i] for r in runs]) - base, "max"))
         for i in (1, 2, 3)]
    ring = 2 * (d - 1) / d  # bytes a rank sends per byte reduced
    beta = max(1e-15, (t[2] - t[1]) / (ring * (SIZES[2] - SIZES[1])))
    alpha = max(0.0, (t[0] - ring * SIZES[0] * beta) / (2 * (d - 1)))
    return Link(latency=alpha, bandwidth=1 / beta)


def inter_link(world, node) -> Link:
    """The link between nodes (collective over the world; ``node``: this rank's node). With
    one rank per node, :func:`link_of` over them all. Otherwise over one rank of each node
    (local rank 0's, the others sleeping): then every byte it reduces crosses once in each
    direction whatever algorithm MPI picks, so the bandwidth is what the node's link
    carries, not what a formula assumes a many-rank all-reduce sends; with the ports of a
    node's link (:func:`ports_of`)."""
    if world.allreduce(node.size, "max") == 1:
        return link_of(world, repeats=16)
    cross = comm.split(world, node.rank, world.rank, "cross")
    link = world.bcast_obj(_only(world, node.rank == 0, lambda: link_of(cross, repeats=16)))
    return dataclasses.replace(link, ports=ports_of(world, node))


def ports_of(world, node, nbytes: int = 8 << 20, repeats: int = 4) -> float:
    """How many ranks of a node send across at the inter link's bandwidth at once
    (collective over the world; ``node``: this rank's node, all of one size): the ranks of
    one local number form a group across the nodes (as the cross-node step of a
    hierarchical reduction, or HSDP's all-reduce across shard groups), which all-reduces
    ``nbytes``; first the group of local rank 0 alone, then every group at once,
    interleaved; ``rpn x t_one / t_all`` (medians, slowest rank) to 2 decimals, within 1
    and the node's ranks. 1: the node's ranks share one link; on the simulated nodes two
    flows carry more than one (TCP, both directions at once), less than two."""
    rpn = node.size
    if world.allreduce(rpn, "min") != world.allreduce(rpn, "max"):
        return 1  # nodes of unequal sizes: no groups by local number; assume one port
    cross = comm.split(world, node.rank, world.rank, "cross")
    x = torch.ones(nbytes // 4)

    def timed(active: bool) -> float:
        world.barrier()
        t0 = time.perf_counter()
        if active:
            cross.allreduce_(x)
        return world.allreduce(time.perf_counter() - t0, "max")
    one, every = [], []
    for _ in range(repeats):
        one.append(timed(node.rank == 0))
        every.append(timed(True))
    ratio = rpn * statistics.median(one) / max(1e-9, statistics.median(every))
    return max(1.0, min(float(rpn), round(ratio, 2)))


def sum16_cost(elements: int = 1 << 21, repeats: int = 5) -> float:
    """Seconds per element of the ``sum16`` op (the software sum of bfloat16 gradient
    traffic, ``comm/sum16.py``) on this rank: the median over ``repeats``."""
    from ..comm.sum16 import add_bf16

    a = torch.ones(elements, dtype=torch.bfloat16)
    b = torch.ones(elements, dtype=torch.bfloat16)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        add_bf16(memoryview(a.view(torch.int16).numpy()), memoryview(b.view(torch.int16).numpy()))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / elements


def call_overhead(cfg: Config, group, link: Link, repeats: int = 30) -> dict | None:
    """The cost of each tp collective of a step as a layout issues it: the config's whole
    model, split over ``group`` as tensor parallelism splits it, forward + backward of one
    microbatch through ``parallel/tensor.py``'s autograd functions, against the same split
    model whose tp functions do not communicate, interleaved, on every rank at once. Per
    call (``per_call`` s): the difference over the calls a step issues (``calls``, counted
    by the group's recorder, ``bytes`` each on average): the link's time, the dispatch
    around it and the wait for a peer that computed slower (the other ranks of a shared
    machine). ``overhead``: what the link's alpha-beta does not explain
    (``call_overhead_s``). Trimmed means over repeats (:func:`trimmed_mean`), the slowest rank's.
    Collective over ``group``; None when the model does not split over it."""
    from ..model import DecoderStage, LocalOps, init_parameters
    from ..parallel.tensor import TensorParallelOps

    m, tr, d = cfg.model, cfg.train, group.size
    if m.n_heads % d or m.kv_heads % d or m.ffn_dim % d:
        return None
    silent = LocalOps()
    silent.tp_size, silent.tp_rank = d, group.rank
    x = torch.randint(0, m.vocab_size // d, (tr.micro_batch_size, tr.seq_len))
    stages = []
    for ops in (TensorParallelOps(group), silent):
        stages.append(DecoderStage(m, range(m.n_layers), first=True, last=True, ops=ops))
        init_parameters([stages[-1]], seed=1, tp_size=d, tp_rank=group.rank)
    rec = group.recorder
    before = rec.calls[group.axis], rec.bytes[group.axis]
    times: list[list[float]] = [[], []]
    for r in range(repeats + 1):
        for k, stage in enumerate(stages):
            t = step_seconds(stage, x)
            if r:  # the first round warms up
                times[k].append(t)
    calls = (rec.calls[group.axis] - before[0]) / (repeats + 1)
    nbytes = (rec.bytes[group.axis] - before[1]) / (repeats + 1) / calls
    extra = trimmed_mean(times[0]) - trimmed_mean(times[1])
    per_call = max(0.0, group.allreduce(extra, "max")) / calls
    return {"per_call": per_call, "calls": calls, "bytes": nbytes,
            "overhead": max(0.0, per_call - allreduce(nbytes, d, link))}


def compute_share(cfg: Config, world, rounds: int = 4, repeats: int = 5) -> float:
    """The fraction of its one-rank speed a rank keeps when every rank of the world computes
    at once (collective): in each of ``rounds``, rank 0 runs the whole model's forward +
    backward at microbatch 4B alone (the others sleep), then every rank runs it at once;
    rank 0's median alone over the ranks' mean of their medians together. Alternating the
    two puts a change of the machine's speed on both alike. Below 1 where ranks share cores
    (simulated nodes on one machine), memory bandwidth or hyperthreads; 1 for one rank.
    The cost model divides a rank's compute and its per-layer, per-stage, hook and ring
    overheads (CPU work alike) by it, for layouts of more than one rank."""
    if world.size == 1:
        return 1.0
    stage = whole_model(cfg)
    x = torch.randint(0, cfg.model.vocab_size, (4 * cfg.train.micro_batch_size,
                                                cfg.train.seq_len))

    def once() -> float:
        return step_seconds(stage, x)
    once()
    alone, together = [], []
    for _ in range(rounds):
        _alone(world, lambda: alone.extend(once() for _ in range(repeats)))
        together.extend(once() for _ in range(repeats))
    mean_together = world.allreduce(statistics.median(together)) / world.size
    share = statistics.median(alone) / mean_together if world.rank == 0 else 0.0
    return min(1.0, world.bcast_obj(share))


def _alone(world, fn):
    """Run ``fn`` on rank 0 while the others sleep (not spin in MPI: rank 0 keeps a core to
    itself); collective, returns ``fn``'s result on rank 0, None elsewhere."""
    return _only(world, world.rank == 0, fn)


def _only(world, active: bool, fn):
    """Run ``fn`` on the ranks where ``active`` while the others sleep (collective);
    ``fn``'s result there, None elsewhere."""
    flag = torch.zeros(1)
    if active:
        out = fn()
        world.iallreduce_(flag).wait()
        return out
    handle = world.iallreduce_(flag)
    while not handle.test():
        time.sleep(0.005)
    return None


def calibrate(cfg: Config, base: Cluster, name: str) -> Cluster | None:
    """Collective over the world: measure, and (rank 0) return the description."""
    world = comm.world()
    comm.abort_on_exception(world)  # a rank's uncaught exception ends the job
    # rank 0 alone (the others sleep, not spin in MPI, so that it has a core to itself):
    # the rate of one rank; then all ranks at once for what a rank keeps of it
    # (compute_share)
    alone = comm.split(world, world.rank, 0, "dp")  # a one-rank group: hooks, no transfer
    pick = world.bcast_obj(_alone(world, lambda: compute_rate(cfg, alone)))
    node = comm.node_local(world)
    nodes = world.allreduce(1.0 if node.rank == 0 else 0.0)
    intra = link_of(node) if node.size > 1 else base.intra
    inter = inter_link(world, node) if nodes > 1 else base.inter
    sum16 = world.allreduce(sum16_cost(), "max")
    calls = call_overhead(cfg, node, intra) if node.size > 1 else None
    posted = post_cost(cfg, node, alone, intra) if node.size > 1 else None
    # one rank per node measures neither: the base description's values stand
    overhead = world.allreduce(calls["overhead"] if calls else -1.0, "max")
    overhead = base.call_overhead_s if overhead < 0 else overhead
    post = world.allreduce(posted["overhead"] if posted else -1.0, "max")
    post = base.post_overhead_s if post < 0 else post
    share = compute_share(cfg, world)
    if world.rank:
        return None
    load = os.getloadavg()
    cores = os.cpu_count() or 1
    rpn = node.size if node.size > 1 else cores  # one process: one rank per core
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // rpn
    return dataclasses.replace(
        base, name=os.path.splitext(os.path.basename(name))[0], ranks_per_node=rpn,
        source=f"hpctrain plan --calibrate on {comm.processor_name()}, "
               f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        peak_flops={cfg.model.dtype: pick["peak"]}, memory=ram,
        efficiency=min(1.0, pick["rate"] / pick["peak"]), overhead_s=pick["overhead_s"],
        pass_overhead_s=pick["pass_overhead_s"], hook_overhead_s=pick["hook_overhead_s"],
        ring_overhead_s=pick["ring_overhead_s"],
        **{k: pick[k] for k in ("split_b", "split_w") if k in pick},
        step_overhead_s=pick["step_overhead_s"], intra=intra, inter=inter,
        call_overhead_s=overhead,
        post_overhead_s=post, sum16_s=sum16,
        compute_share=share,
        extra={"load_average": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
               "ranks": world.size, "nodes": int(nodes),
               "tp_call_s": calls["per_call"] if calls else 0.0,
               "model_rate_flops": pick["rate"],
               "layer_flops_per_token": layer_flops(cfg, 0)})
