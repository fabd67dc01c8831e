"""``hpctrain plan CONFIG --calibrate OUT.toml``: measure this machine, write a description.

Run on every rank (``mpirun -n N ... -m hpctrain plan CONFIG --world-size N --calibrate
OUT.toml``; one process measures compute only, the links keep the base description's):

- **compute** (rank 0 alone, the others waiting): the peak of square matrix
  multiplies in the model's dtype (``telemetry/flops.measure_peak_flops``), and the config's
  whole model forward + backward on one process at microbatch B and 4B: the difference
  gives the achieved rate (``efficiency`` = rate / peak), the rest the per-layer overhead;
  the optimizer step (``torch.optim.AdamW`` over the same parameters) gives
  ``step_overhead_s``;
- **links** (all ranks together, through ``comm`` only): all-reduces of 8 B and 1 MiB over
  the ranks of one node (``intra``) and, when the ranks span nodes, over all ranks
  (``inter``); latency and bandwidth from the ring formula's two unknowns;
- **calls** (the ranks of each node): the model split over them by tensor parallelism,
  with and without its collectives; what each call costs beyond the intra link's
  alpha-beta is ``call_overhead_s``.

Medians over repeats; the machine is shared, so the load average is written beside them.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch

from .. import comm
from ..config import Config
from ..telemetry.flops import forward_flops_per_token, measure_peak_flops
from .cluster import Cluster, Link
from .collectives import allreduce
from .cost import layer_flops

SIZES = (8, 1 << 20)


def _median_time(fn, repeats: int, stat=statistics.median) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return stat(out)


def _whole_model(cfg: Config, layers: int = 0):
    """The config's model (its first ``layers`` blocks only, if given) as one stage."""
    from ..model import GPTStage, init_parameters

    stage = GPTStage(cfg.model, range(layers or cfg.model.n_layers), first=True, last=True)
    init_parameters([stage], seed=1)
    return stage


def _model_time(stage, cfg: Config, batch: int, repeats: int) -> float:
    """Median seconds of one forward + backward of the whole model on ``batch`` sequences."""
    x = torch.randint(0, cfg.model.vocab_size, (batch, cfg.train.seq_len))

    def step():
        stage.zero_grad(set_to_none=True)
        stage(x, x).backward()
    return _median_time(step, repeats)


def compute_rate(cfg: Config, alone=None, repeats: int = 5) -> dict:
    """One process: peak FLOP/s, achieved model rate, per-layer and per-stage-pass
    overheads, the gradient hooks' cost (over ``alone``, a one-rank group), optimizer step."""
    stage = _whole_model(cfg)
    m, T, B = cfg.model, cfg.train.seq_len, cfg.train.micro_batch_size
    f1, f4 = (b * T * forward_flops_per_token(m, T) for b in (B, 4 * B))
    t1, t4 = _model_time(stage, cfg, B, repeats), _model_time(stage, cfg, 4 * B, repeats)
    peak = measure_peak_flops(getattr(torch, m.dtype))
    # two unknowns from two noisy times: the rate lies between what 4B achieves with no
    # overhead at all and the matrix multiplies' peak (t4 - t1 <= 0 under load: the peak)
    rate = 3 * (f4 - f1) / (t4 - t1) if t4 > t1 else peak
    rate = min(peak, max(3 * f4 / t4, rate))
    layer, per_pass = _overheads(cfg, t1, f1, rate, repeats)
    opt = torch.optim.AdamW(stage.parameters(), foreach=False)
    return {"peak": peak, "rate": rate, "overhead_s": layer, "pass_overhead_s": per_pass,
            "hook_overhead_s": hook_cost(cfg, alone, repeats) if alone is not None else 0.0,
            "ring_overhead_s": ring_cost(cfg, alone, repeats) if alone is not None else 0.0,
            **(split_cost(cfg, 2 * repeats) if alone is not None else {}),
            "t4": t4, "step_overhead_s": _median_time(opt.step, repeats)}


def _overheads(cfg: Config, t1: float, f1: float, rate: float,
               repeats: int) -> tuple[float, float]:
    """(per layer, per stage) seconds of one forward or backward pass beyond the FLOPs at
    ``rate``: the whole model (``t1`` s, ``f1`` FLOPs at microbatch B) against its first
    half of the blocks with the same ends (embedding, head, loss, the autograd call: what a
    pipeline stage pays whatever its layers). One block: all per layer."""
    m, T, B = cfg.model, cfg.train.seq_len, cfg.train.micro_batch_size
    L, half = m.n_layers, m.n_layers // 2
    if half < 1:
        return max(0.0, (t1 - 3 * f1 / rate) / (3 * L)), 0.0
    fh = f1 - B * T * sum(layer_flops(cfg, i) for i in range(half, L))
    th = _model_time(_whole_model(cfg, half), cfg, B, repeats)
    layer = max(0.0, ((t1 - th) - 3 * (f1 - fh) / rate) / (3 * (L - half)))
    per_pass = max(0.0, (t1 - 3 * f1 / rate) / 3 - L * layer)
    return layer, per_pass


def hook_cost(cfg: Config, alone, repeats: int = 5, microbatches: int = 4) -> float:
    """Seconds per parameter tensor and microbatch that the gradient hooks add: the whole
    model's backward over ``microbatches`` with ZeRO-2's hooks (``parallel/data.py`` over the
    one-rank group ``alone``: the staging copy, the counts, the posting; nothing travels)
    against the same model without, interleaved, medians."""
    from types import SimpleNamespace

    from ..parallel.data import GradBuffers

    plain, hooked = _whole_model(cfg), _whole_model(cfg)
    named = list(hooked.named_parameters())
    topo = SimpleNamespace(dpcp_comm=alone, edpcp_comm=alone, tp_comm=alone, tp_size=1)
    grads = GradBuffers(named, topo, cfg.optim.bucket_mb, zero=2,
                        microbatches=microbatches, progress="test")
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len))

    def run(stage, g=None):
        g.zero() if g is not None else stage.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for _ in range(microbatches):
            stage(x, x).backward()
        if g is not None:
            g.reduce()
        return time.perf_counter() - t0
    run(plain), run(hooked, grads)
    times = [(run(plain), run(hooked, grads)) for _ in range(repeats)]
    extra = statistics.median(b for _, b in times) - statistics.median(a for a, _ in times)
    return max(0.0, extra / (microbatches * len(named)))


def link_of(group, repeats: int = 40) -> Link:
    """Latency and bandwidth of ``group``'s ring all-reduce (collective). As in training,
    every all-reduce follows about 1 ms of computation, so the latency includes the time a
    rank that yielded its core (or lost it to other work) takes to come back; the *mean*
    over repeats, because a step pays the sum of many such delays, long tail included."""
    d = group.size
    a = torch.randn(96, 96)

    def work():
        for _ in range(8):
            a @ a
    t = []
    for n in SIZES:
        x = torch.ones(max(1, n // 4), dtype=torch.float32)

        def once(x=x):
            work()
            group.allreduce_(x)
        mean = statistics.fmean
        t.append(group.allreduce(_median_time(once, repeats, mean)
                                 - _median_time(work, repeats, mean), "max"))
    t = [max(1e-9, s) for s in t]
    beta = max(1e-15, (t[1] - t[0]) / (2 * (d - 1) / d * (SIZES[1] - SIZES[0])))
    alpha = max(0.0, (t[0] - 2 * (d - 1) / d * SIZES[0] * beta) / (2 * (d - 1)))
    return Link(latency=alpha, bandwidth=1 / beta)


def call_overhead(cfg: Config, group, link: Link, repeats: int = 10) -> dict | None:
    """The cost of each tp collective of a step as a layout issues it: the config's whole
    model, split over ``group`` as tensor parallelism splits it, forward + backward of one
    microbatch through ``parallel/tensor.py``'s autograd functions, against the same split
    model whose tp functions do not communicate, interleaved, on every rank at once. Per
    call (``per_call`` s): the difference over the calls a step issues (``calls``, counted
    by the group's recorder, ``bytes`` each on average): the link's time, the dispatch
    around it and the wait for a peer that computed slower (the other ranks of a shared
    machine). ``overhead``: what the link's alpha-beta does not explain
    (``call_overhead_s``). Means over repeats (a step pays the sum), the slowest rank's.
    Collective over ``group``; None when the model does not split over it."""
    from ..model import GPTStage, LocalOps, init_parameters
    from ..parallel.tensor import TensorParallelOps

    m, tr, d = cfg.model, cfg.train, group.size
    if m.n_heads % d or m.kv_heads % d or m.ffn_dim % d:
        return None
    silent = LocalOps()
    silent.tp_size, silent.tp_rank = d, group.rank
    x = torch.randint(0, m.vocab_size // d, (tr.micro_batch_size, tr.seq_len))
    stages = []
    for ops in (TensorParallelOps(group), silent):
        stages.append(GPTStage(m, range(m.n_layers), first=True, last=True, ops=ops))
        init_parameters([stages[-1]], seed=1, tp_size=d, tp_rank=group.rank)
    rec = group.recorder
    before = rec.calls[group.axis], rec.bytes[group.axis]
    times: list[list[float]] = [[], []]
    for r in range(repeats + 1):
        for k, stage in enumerate(stages):
            stage.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            stage(x, x).backward()
            if r:  # the first round warms up
                times[k].append(time.perf_counter() - t0)
    calls = (rec.calls[group.axis] - before[0]) / (repeats + 1)
    nbytes = (rec.bytes[group.axis] - before[1]) / (repeats + 1) / calls
    extra = statistics.fmean(times[0]) - statistics.fmean(times[1])
    per_call = max(0.0, group.allreduce(extra, "max")) / calls
    return {"per_call": per_call, "calls": calls, "bytes": nbytes,
            "overhead": max(0.0, per_call - allreduce(nbytes, d, link))}


def ring_cost(cfg: Config, alone, repeats: int = 5) -> float:
    """Seconds per layer and pass unit (forward 1, backward 2) that context parallelism's
    ring attention (``parallel/context.py``) adds beyond the attention's FLOPs: one layer's
    attention of a microbatch over the one-rank ring ``alone`` (its block, the log-sum-exp
    merge, the gradient hop to itself) against PyTorch's fused causal attention of the same
    tensors, interleaved, medians, per 3 pass units. Mostly fixed per call (measured: 2.1 ms
    a layer on 1 rank, 2.2 ms in the cp=2 runs' profile), so the model charges it per layer."""
    from ..parallel.context import RingContext

    m, B, T = cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len
    T -= T % 2  # the ring's two chunks
    dtype = getattr(torch, m.dtype)
    q, k, v = (torch.randn(B, m.n_heads, T, m.head_dim, dtype=dtype, requires_grad=True)
               for _ in range(3))
    ring = RingContext(alone)
    fused = torch.nn.functional.scaled_dot_product_attention

    def run(attend):
        t0 = time.perf_counter()
        attend().sum().backward()
        return time.perf_counter() - t0
    ways = (lambda: ring.attention(q, k, v, 1), lambda: fused(q, k, v, is_causal=True))
    times = [[run(f) for f in ways] for _ in range(repeats + 1)][1:]
    extra = statistics.median(r for r, _ in times) - statistics.median(f for _, f in times)
    return max(0.0, extra / 3)


def split_cost(cfg: Config, repeats: int = 5) -> dict:
    """Zero-bubble's split backward on the whole model (``schedule/zero_bubble.py``): B
    (input gradients, the weight matmuls kept) and W (their weight gradients) each over one
    ordinary backward of the same forward, interleaved, medians: ``split_b``, ``split_w``."""
    from ..model import weight_grad
    from ..schedule.zero_bubble import input_grad
    from ..schedule.zero_bubble import weight_grad as apply_w

    stage = _whole_model(cfg)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len))

    def plain() -> tuple:
        stage.zero_grad(set_to_none=True)
        out = stage(x, x)
        t0 = time.perf_counter()
        out.backward()
        return (time.perf_counter() - t0,)

    def split() -> tuple:
        stage.zero_grad(set_to_none=True)
        with weight_grad.armed():
            out = stage(x, x)
            t0 = time.perf_counter()
            _, pending = input_grad(out, None, None)
            t1 = time.perf_counter()
            apply_w(pending)
        return time.perf_counter() - t1, t1 - t0
    rounds = [(plain(), split()) for _ in range(repeats + 1)][1:]
    back = statistics.median(p[0] for p, _ in rounds)
    w, b = (statistics.median(s[k] for _, s in rounds) for k in (0, 1))
    return {"split_b": min(4.0, b / back), "split_w": min(4.0, w / back)}


def compute_share(cfg: Config, world, alone_s: float) -> float:
    """The fraction of its one-rank speed a rank keeps when every rank of the world computes
    at once (collective): rank 0's time for the larger batch alone (``alone_s``) over the
    mean time of the same work on all ranks together. Below 1 where ranks share cores
    (simulated nodes on one machine), memory bandwidth or hyperthreads; 1 for one rank.
    The cost model applies it to layouts of more than one rank."""
    if world.size == 1:
        return 1.0
    mine = _model_time(_whole_model(cfg), cfg, 4 * cfg.train.micro_batch_size, repeats=3)
    together = world.allreduce(mine) / world.size
    return min(1.0, alone_s / together)


def calibrate(cfg: Config, base: Cluster, name: str) -> Cluster | None:
    """Collective over the world: measure, and (rank 0) return the description."""
    world = comm.world()
    # rank 0 alone (the others sleep, not spin in MPI, so that it has a core to itself):
    # the rate of one rank; then all ranks at once for what a rank keeps of it
    # (compute_share)
    flag = torch.zeros(1)
    alone = comm.split(world, world.rank, 0, "dp")  # a one-rank group: hooks, no transfer
    if world.rank == 0:
        mine = compute_rate(cfg, alone)
        world.iallreduce_(flag).wait()
    else:
        mine, handle = None, world.iallreduce_(flag)
        while not handle.test():
            time.sleep(0.02)
    pick = world.bcast_obj(mine)
    node = comm.node_local(world)
    nodes = world.allreduce(1.0 if node.rank == 0 else 0.0)
    intra = link_of(node) if node.size > 1 else base.intra
    inter = link_of(world) if nodes > 1 else base.inter
    calls = call_overhead(cfg, node, intra) if node.size > 1 else None
    overhead = world.allreduce(calls["overhead"] if calls else -1.0, "max")
    overhead = base.call_overhead_s if overhead < 0 else overhead
    share = compute_share(cfg, world, pick["t4"])
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
        compute_share=share,
        extra={"load_average": f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
               "ranks": world.size, "nodes": int(nodes),
               "tp_call_s": calls["per_call"] if calls else 0.0,
               "model_rate_flops": pick["rate"],
               "layer_flops_per_token": layer_flops(cfg, 0)})
