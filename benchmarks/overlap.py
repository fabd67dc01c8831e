"""Exposed gradient-sync time with and without overlap, and how overlapped reductions
progress (``optim.overlap_progress``).

Every variant is its own copy of the same model (same init) with its own
``grad_sync.create``; one step = forward and backward of every microbatch, then
the strategy's ``reduce()``; the slowest rank's time. Variants, interleaved step by step:

- compute only: the same step without any reduction (the floor);
- no overlap: one blocking all-reduce per bucket after backward (``optim.overlap=false``);
- overlap, progress ``wait``: libnbc ``Iallreduce`` posted from the hooks, progressed only
  by the final wait;
- overlap, progress ``test``: the same, plus ``MPI_Test`` on every outstanding request from
  each gradient hook;
- overlap, progress ``thread``: the progress thread runs each bucket's blocking all-reduce on
  a duplicate communicator while backward goes on (``comm/progress.py``);
- per-parameter: one blocking all-reduce per parameter after backward (the naive baseline).

Exposed sync = a variant's step - compute only (medians). Run on the shaped 2-node cluster
with ``scripts/cluster.sh mpirun NAME -n 4 ... -m benchmarks.worker overlap`` (see
docs/results.md, "Overlapped gradient reduction").
"""

from __future__ import annotations

import time

import torch

from hpctrain.parallel import build_model, grad_sync, named_parameters
from hpctrain.topology import Topology

from .common import (
    interleaved,
    median,
    pair_ratios,
    pairs_of,
    ratio,
    result,
    row,
    train_config,
)

RANKS = (2, 4)
# 16 layers: 131 tensors; small: 12.3 MiB of float32 gradients in 4 MiB buckets
MODELS = {"tiny": ["model.n_layers=4", "model.d_model=32", "train.seq_len=16",
                   "train.micro_batch_size=2", "optim.bucket_mb=0.01"],
          "small": ["model.n_layers=16", "model.d_model=128", "train.seq_len=64",
                    "train.micro_batch_size=4", "optim.bucket_mb=1.0"]}
MICROBATCHES = 1  # the whole backward is the overlap window (as in DDP without accumulation)
VARIANTS = {  # name -> grad_sync.create keywords (None: no reduction at all)
    "compute only (no sync)": None,
    "no overlap: blocking buckets after backward": {},
    "overlap, progress wait (libnbc)": {"overlap": True, "progress": "wait"},
    "overlap, progress test (libnbc + MPI_Test in hooks)": {"overlap": True,
                                                            "progress": "test"},
    "overlap, progress thread": {"overlap": True, "progress": "thread"},
    "overlap, progress poll (progress thread, libnbc + MPI_Test)": {"overlap": True,
                                                                   "progress": "poll"},
    "per-parameter (naive)": {"mode": "per-parameter"},
}
BLOCKING, THREAD = "no overlap: blocking buckets after backward", \
    "overlap, progress thread"


class Side:
    """One variant: its own model copy, gradient buffers and data."""

    def __init__(self, cfg, topo, world, kw):
        self.world, self.kw = world, kw
        chunks = build_model(cfg, topo)
        self.model = chunks[0]
        self.params = named_parameters(chunks)
        self.grads = grad_sync.create(self.params, topo, cfg.optim.bucket_mb,
                                 microbatches=MICROBATCHES, **(kw or {}))
        g = torch.Generator().manual_seed(7 + world.rank)
        t, v = cfg.train, cfg.model.vocab_size
        self.data = [torch.randint(0, v, (t.micro_batch_size, t.seq_len + 1), generator=g)
                     for _ in range(MICROBATCHES)]
        self.scale = 1.0 / (world.size * MICROBATCHES * t.micro_batch_size * t.seq_len)

    def step(self) -> float:
        self.grads.zero()
        self.world.barrier()
        t0 = time.perf_counter()
        for xy in self.data:
            (self.model(xy[:, :-1], xy[:, 1:]) * self.scale).backward()
        if self.kw is not None:
            self.grads.reduce()
        return self.world.allreduce(time.perf_counter() - t0, "max")


def _check(sides: dict) -> dict:
    """Reduced gradients of every synchronising variant against the blocking one's."""
    ref = sides[BLOCKING].grads.flats[0]
    err = 0.0
    for s in sides.values():
        if s.kw is not None:
            err = max(err, float((s.grads.flats[0] - ref).abs().max() / ref.abs().max()))
    return {"what": "reduced gradients equal the blocking reduction's", "values": {},
            "rel_err": err, "tol": 1e-5, "ok": err <= 1e-5}


def run(world, size: str, repeats: int) -> dict:
    """Collective over ``world`` (the dp group is the whole world)."""
    cfg = train_config(size, *MODELS[size], f"topology.dp={world.size}")
    topo = Topology(cfg.topology, world)
    sides = {n: Side(cfg, topo, world, kw) for n, kw in VARIANTS.items()}
    for s in sides.values():  # warm-up: allocation, first-touch, lazy init
        s.step()
    samples = interleaved({n: s.step for n, s in sides.items()}, pairs_of(repeats, size))
    check = _check(sides)
    for s in sides.values():
        s.grads.close()
    floor = median(samples["compute only (no sync)"])
    grads = sides[BLOCKING].grads
    nbytes = grads.flats[0].numel() * grads.flats[0].element_size()
    out = result("overlap", world, size, repeats,
                 f"forward+backward of {MICROBATCHES} microbatches then reduce(), "
                 f"{len(sides[BLOCKING].params)} tensors, {nbytes / 2**20:.1f} MiB float32, "
                 f"{len(grads.buckets)} buckets, dp={world.size}")
    out["rows"] = [row(n, v, "s/step") for n, v in samples.items()]
    out["ratios"] = [
        ratio(f"step: no overlap / {label}", 0.0, ">= 1.0",
              pair_ratios(samples[BLOCKING], samples[n]))
        for label, n in (("thread", THREAD),
                         ("poll", "overlap, progress poll (progress thread, libnbc + MPI_Test)"),
                         ("test", "overlap, progress test (libnbc + MPI_Test in hooks)"),
                         ("wait", "overlap, progress wait (libnbc)"))]
    out["ratios"].append(ratio("step: per-parameter / no overlap", 0.0, ">= 1.0",
                               pair_ratios(samples["per-parameter (naive)"], samples[BLOCKING])))
    exposed = {n: (median(v) - floor) * 1e3 for n, v in samples.items()}
    for q, n in zip(out["ratios"], [THREAD, "overlap, progress poll (progress thread, libnbc + "
                                    "MPI_Test)", "overlap, progress test (libnbc + MPI_Test "
                                    "in hooks)", "overlap, progress wait (libnbc)",
                                    "per-parameter (naive)"]):
        q["why"] = (f"exposed gradient sync {exposed[n]:.1f} ms with this variant against "
                    f"{exposed[BLOCKING]:.1f} ms for blocking buckets after backward, on a "
                    f"{floor * 1e3:.0f} ms step without sync" + (
                        ": overlap can win at most the latter" if n != "per-parameter (naive)"
                        else ": the per-call cost is small here"))
    out["table"] = [{"variant": n, "step_s": median(v), "exposed_sync_s": median(v) - floor}
                    for n, v in samples.items()]
    out["notes"] += [f"{n}: exposed gradient sync {(median(v) - floor) * 1e3:.2f} ms "
                     f"(step {median(v) * 1e3:.2f} ms)" for n, v in samples.items()]
    out["check"] = check
    return out
