"""The ranks of :mod:`benchmarks.nodes` inside the simulated cluster (2 nodes x 2 ranks,
``scripts/cluster.sh``), ONE ``mpirun`` of 4 ranks:

    scripts/cluster.sh mpirun NAME -n 4 python -m mpi4py \
        -m benchmarks.nodes_worker --size tiny --repeats 1 --out SAMPLES.json

Every variant trains the same model (``cluster_worker.MODEL``), init, data and global batch,
interleaved repeat by repeat: hpctrain's layouts (:func:`hpctrain_variants`, config overrides
only), the naive baseline (:data:`NAIVE`), PyTorch DDP and FSDP2 (gloo, :func:`torch_steps`)
and ``compute``: every rank training its quarter of the batch alone (no communication).
Rank 0 writes each variant's samples (step seconds, exposed communication per axis, losses).
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from pathlib import Path

from .cluster_worker import MODEL, train_once

BF16 = 'optim.grad_comm_dtype="bfloat16"'
DP4 = ["topology.dp=4"]
HPCTRAIN = {  # name -> overrides on top of MODEL: the layouts that compete
    "hpctrain: overlapped, bf16 traffic": [*DP4, "optim.overlap=true", BF16],
    "hpctrain: hierarchical, bf16 traffic": [*DP4, 'topology.dp_reduction="hierarchical"',
                                             BF16],
    "hpctrain: overlapped, float32 traffic": [*DP4, "optim.overlap=true"],
}
HSDP = ("hpctrain: HSDP (zero 3 in a node), bf16 traffic",
        [*DP4, "optim.zero=3", 'topology.shard_within="node"', BF16])
# flat dp, one blocking all-reduce per parameter, no overlap, ranks placed without regard
# to nodes
NAIVE = [*DP4, 'experimental.reduction="per-parameter"', "optim.overlap_across_nodes=false",
         'experimental.placement="naive"']
TORCH = {"torch DDP (gloo, 4 MB buckets)": ("ddp", 4.0),
         "torch DDP (gloo, 25 MB buckets)": ("ddp", 25.0),
         "torch FSDP2 full shard (gloo)": ("fsdp", (4,)),
         "torch FSDP2 HSDP 2x2 mesh (gloo)": ("fsdp", (2, 2))}


def hpctrain_variants() -> dict[str, list[str]]:
    """hpctrain's variants; HSDP where this build has ``topology.shard_within``."""
    from hpctrain.config import TopologyConfig

    out = dict(HPCTRAIN)
    if "shard_within" in TopologyConfig.__dataclass_fields__:
        out[HSDP[0]] = HSDP[1]
    return out


def _my_address() -> tuple[str, str]:
    """This node's address and interface for gloo: eth0's inside the cluster (a UDP
    connect to the hub sends nothing), else loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.213.0.254", 9))
            return s.getsockname()[0], "eth0"
    except OSError:
        return "127.0.0.1", "lo"


def torch_dist(world):
    """gloo over the nodes' links: rank 0's node address, a port it picked."""
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        return dist
    addr, iface = _my_address()
    with socket.socket() as s:
        s.bind((addr, 0))
        port = s.getsockname()[1]
    addr, port = world.bcast_obj((addr, port) if world.rank == 0 else None)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=iface)
    dist.init_process_group("gloo", init_method="env://", rank=world.rank,
                            world_size=world.size)
    return dist


def _wrap(stage, kind: str, arg, world):
    """DDP in its best settings (bucket ``arg`` MB, gradient_as_bucket_view, static graph),
    or FSDP2 ``fully_shard`` per block and at the root over a mesh of shape ``arg``
    ((4,): full shard; (2, 2): replicate across nodes x shard within a node)."""
    import torch

    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(
            stage, bucket_cap_mb=arg, gradient_as_bucket_view=True, static_graph=True)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("shard",) if len(arg) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", arg, mesh_dim_names=names)
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh)
    return fully_shard(stage, mesh=mesh)


def torch_steps(cfg, world, kind: str, arg) -> dict:
    """hpctrain's training as a PyTorch loop (torch AdamW, clip, accumulation) under DDP or
    FSDP2; rank 0's step seconds and losses."""
    import torch

    from hpctrain.data.dataset import Sampler, load_tokens
    from hpctrain.optim import lr_at

    from .common import local_model, torch_optimizer

    dist = torch_dist(world)
    t, o = cfg.train, cfg.optim
    model = _wrap(local_model(cfg), kind, arg, world)
    params = list(model.parameters())
    opt = torch_optimizer(params, o)
    tokens = load_tokens(cfg.data.path, "train", cfg.data.corpus_mb, cfg.data.val_fraction)
    sampler = Sampler(tokens.tokens, t.seq_len, t.global_batch_size, t.micro_batch_size,
                      world.size, world.rank, t.seed)
    scale = world.size / (t.global_batch_size * t.seq_len)  # both average over ranks
    times, losses = [], []
    for step in range(t.steps):
        dist.barrier()
        t0 = time.perf_counter()
        mbs = sampler.local(step)
        opt.zero_grad(set_to_none=kind != "ddp")
        total = 0.0
        for j, (x, y) in enumerate(mbs):
            last = j == len(mbs) - 1
            if kind == "ddp":
                ctx = contextlib.nullcontext() if last else model.no_sync()
            else:
                model.set_requires_gradient_sync(last)
                ctx = contextlib.nullcontext()
            with ctx:
                loss = model(x, y)
                (loss * scale).backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, o, t.steps)
        opt.step()
        buf = torch.tensor([total], dtype=torch.float64)
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
        losses.append(float(buf[0]) / (t.global_batch_size * t.seq_len))
    return {"step_s": times, "comm_s": [{} for _ in times], "losses": losses}


def compute_overrides(size: str) -> list[str]:
    """One rank alone on a quarter of the global batch: the same microbatches per rank."""
    g = next(int(x.split("=")[1]) for x in MODEL[size] if x.startswith("train.global_batch"))
    return [f"train.global_batch_size={g // 4}", "topology.dp=1"]


def one(world, solo, name: str, size: str) -> dict | None:
    from .common import train_config

    if name in TORCH:
        cfg = train_config(size, *MODEL[size])
        res = torch_steps(cfg, world, *TORCH[name])
        return res if world.rank == 0 else None
    if name == "compute":
        return train_once(world, solo, [*MODEL[size], *compute_overrides(size)], size)
    extra = NAIVE if name == "naive baseline" else hpctrain_variants()[name]
    return train_once(world, world, [*MODEL[size], *extra], size)


def main(argv=None) -> int:
    import argparse

    from hpctrain import comm

    p = argparse.ArgumentParser(prog="python -m benchmarks.nodes_worker")
    p.add_argument("--size", default="tiny")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    world = comm.world()
    solo = comm.split(world, world.rank, 0, "bench-solo")
    names = ["naive baseline", *hpctrain_variants(), *TORCH, "compute"]
    samples: dict[str, list] = {k: [] for k in names}
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            res = one(world, solo, name, args.size)
            if world.rank == 0:
                samples[name].append(res)
                print(f"[nodes] {name}: {[round(s, 3) for s in res['step_s']]}", flush=True)
    if world.rank == 0:
        Path(args.out).write_text(json.dumps(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
