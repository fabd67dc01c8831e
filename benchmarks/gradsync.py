"""Gradient synchronisation of a model with 100+ parameter tensors over the dp group:
hpctrain's blocking buckets (``grad_sync.BlockingBuckets.reduce()``) against one MPI call
per parameter (``per_parameter.reduce_per_parameter``, the naive baseline) and against one
raw all-reduce of all gradient bytes in one buffer (the limit: same bytes, one call, nothing
else)."""

from __future__ import annotations

import time

import torch

from hpctrain.config import load
from hpctrain.parallel import build_model, grad_sync, named_parameters
from hpctrain.parallel.grad_sync.buckets import reduce_per_parameter
from hpctrain.topology import Topology

from .common import max_over_ranks, median, pair_ratios, pairs_of, ratio, result, row

RANKS = (2, 4)
# 8 tensors per block + embedding, final norm, head: 16 layers -> 131 tensors.
MODELS = {"tiny": ["model.n_layers=13", "model.d_model=32", "model.n_heads=4"],
          "small": ["model.n_layers=16", "model.d_model=128", "model.n_heads=4"]}
TRIALS = {"tiny": 2, "small": 4}  # timed reductions per variant per repeat


def _setup(world, size: str):
    cfg = load(None, [*MODELS[size], 'model.dtype="float32"', f"topology.dp={world.size}",
                      "optim.bucket_mb=4.0"])
    topo = Topology(cfg.topology, world)
    params = named_parameters(build_model(cfg, topo))
    grads = grad_sync.create(params, topo, cfg.optim.bucket_mb)
    (flat,) = grads.flats  # every gradient is a view into this buffer
    g = torch.Generator().manual_seed(1000 + world.rank)
    source = torch.randn(flat.numel(), generator=g, dtype=flat.dtype)
    return cfg, topo, params, grads, flat, source


def run(world, size: str, repeats: int) -> dict:
    """Collective over ``world`` (the dp group is the whole world here)."""
    cfg, topo, params, grads, flat, source = _setup(world, size)
    variants = {
        "hpctrain bucketed": grads.reduce,
        "per-parameter": lambda: reduce_per_parameter(grads.layout),
        "limit: one Allreduce": lambda: topo.dp_comm.allreduce_(flat),
    }
    samples = {k: [] for k in variants}
    results = {}
    names = list(variants)
    for r in range(pairs_of(repeats, size) * TRIALS[size]):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            flat.copy_(source)
            world.barrier()
            t0 = time.perf_counter()
            variants[name]()
            samples[name].append(max_over_ranks(world, time.perf_counter() - t0))
            if name not in results:
                results[name] = flat.clone()
    ref = results["limit: one Allreduce"]
    err = max(float((results[n] - ref).abs().max() / ref.abs().max()) for n in names)
    nbytes = flat.numel() * flat.element_size()
    out = result("gradsync", world, size, repeats,
                 f"{len(params)} tensors, {nbytes / 2**20:.1f} MiB float32, "
                 f"{len(grads.buckets)} buckets of <= {cfg.optim.bucket_mb} MiB, "
                 f"dp={world.size}")
    out["rows"] = [row(n, samples[n], "s") for n in names]
    per_param = ratio("per-parameter / bucketed", 0.0, ">= 3",
                      pair_ratios(samples["per-parameter"], samples["hpctrain bucketed"]))
    per_param["why"] = per_call(samples, len(params), len(grads.buckets), 3.0)
    out["ratios"] = [
        ratio("bucketed / limit", 0.0, "<= 1.15",
              pair_ratios(samples["hpctrain bucketed"], samples["limit: one Allreduce"])),
        per_param,
    ]
    out["check"] = {"what": "reduced gradients equal the limit's", "values": {},
                    "rel_err": err, "tol": 1e-6, "ok": err <= 1e-6}
    out["notes"].append(f"{len(params)} parameter tensors, {nbytes:,} bytes")
    return out


def per_call(samples: dict, calls: int, buckets: int, target: float) -> str:
    """The measured price of a call: what the per-parameter reduction's extra calls cost each
    (medians), and what each would have to cost for ``target`` x the bucketed time."""
    t_pp, t_b = median(samples["per-parameter"]), median(samples["hpctrain bucketed"])
    extra = max(1, calls - buckets)
    each, need = (t_pp - t_b) / extra, (target - 1) * t_b / extra
    return (f"a call costs {each * 1e6:.0f} us here ({calls} per-parameter calls "
            f"{t_pp * 1e3:.2f} ms against {buckets} buckets {t_b * 1e3:.2f} ms, same bytes); "
            f"{target:g}x needs {need * 1e6:.0f} us per call, a network's latency")
