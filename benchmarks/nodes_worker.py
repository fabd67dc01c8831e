"""The ranks of :mod:`benchmarks.nodes` inside the simulated cluster (2 nodes x 2 ranks,
``scripts/cluster.sh``), ONE ``mpirun`` of 4 ranks:

    scripts/cluster.sh mpirun NAME -n 4 python -m mpi4py \
        -m benchmarks.nodes_worker --size tiny --repeats 1 --out SAMPLES.json

Every variant trains the same model (``cluster_worker.MODEL``), init, data and global batch,
interleaved repeat by repeat: hpctrain's layouts (:func:`hpctrain_variants`, config overrides
only), the naive baseline (:data:`NAIVE`), PyTorch DDP and FSDP2 (gloo, :func:`torch_steps`,
in processes of their own: :mod:`benchmarks.torch_peers`) and ``compute``: every rank
training its quarter of the batch alone (no communication).
Rank 0 writes each variant's samples (step seconds, exposed communication per axis, losses).
"""

from __future__ import annotations

from .cluster_worker import MODEL, interleave, train_once, worker_args

BF16 = 'optim.grad_comm_dtype="bfloat16"'
DP4 = ["topology.dp=4"]
HPCTRAIN = {  # name -> overrides on top of MODEL: the layouts that compete, each precision
    "hpctrain overlapped, bf16": [*DP4, "optim.overlap=true", BF16],
    "hpctrain hierarchical, bf16": [*DP4, 'topology.dp_reduction="hierarchical"',
                                             BF16],
    "hpctrain overlapped, fp32": [*DP4, "optim.overlap=true"],
    "hpctrain hierarchical, fp32": [*DP4, 'topology.dp_reduction="hierarchical"'],
    "hpctrain hierarchical overlapped, bf16": [*DP4, 'topology.dp_reduction="hierarchical"',
                                               "optim.overlap=true", BF16],
    "hpctrain hierarchical overlapped, fp32": [*DP4, 'topology.dp_reduction="hierarchical"',
                                               "optim.overlap=true"],
    "hpctrain HSDP (zero 3 in a node), bf16":
        [*DP4, "optim.zero=3", 'topology.shard_within="node"', BF16],
}
# flat dp, one blocking all-reduce per parameter, no overlap, ranks placed without regard
# to nodes
NAIVE = [*DP4, 'experimental.reduction="per-parameter"', "optim.overlap_across_nodes=false",
         'experimental.placement="naive"']
# name -> (kind, argument, 16-bit traffic): DDP (gloo) with float32 buckets or a bf16 compress
# hook, FSDP2 (gloo) with float32 or bfloat16 reduce_dtype; names end in their traffic's
# precision, fp32 or bf16
TORCH = {"DDP 4 MB, fp32": ("ddp", 4.0, False),
         "DDP 25 MB, fp32": ("ddp", 25.0, False),
         "DDP 4 MB + bf16 hook, bf16": ("ddp", 4.0, True),
         "FSDP2 full shard, fp32": ("fsdp", (4,), False),
         "FSDP2 HSDP 2x2, fp32": ("fsdp", (2, 2), False),
         "FSDP2 full shard, bf16": ("fsdp", (4,), True),
         "FSDP2 HSDP 2x2, bf16": ("fsdp", (2, 2), True)}


# the smoke test (size tiny) runs one of each kind: seconds, not a comparison
TINY = ("naive baseline", "hpctrain overlapped, bf16",
        "DDP 4 MB + bf16 hook, bf16",
        "FSDP2 HSDP 2x2, bf16", "compute")


def variant_names(size: str) -> list[str]:
    """Every variant, interleaved in this order (at ``tiny``: :data:`TINY`)."""
    names = ["naive baseline", *hpctrain_variants(), *TORCH, "compute"]
    return [n for n in names if size != "tiny" or n in TINY]


def hpctrain_variants() -> dict[str, list[str]]:
    """hpctrain's variants (name -> config overrides)."""
    return dict(HPCTRAIN)


def _wrap(stage, kind: str, arg, bf16: bool):
    """DDP in its best settings (bucket ``arg`` MB, gradient_as_bucket_view, static graph;
    ``bf16``: :func:`bfloat16_wire_hook`), or FSDP2 ``fully_shard`` per block and at the
    root over a mesh of shape ``arg`` ((4,): full shard; (2, 2): replicate across nodes x
    shard within a node; ``bf16``: ``reduce_dtype`` bfloat16)."""
    import torch

    if kind == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(
            stage, bucket_cap_mb=arg, gradient_as_bucket_view=True, static_graph=True)
        if bf16:
            ddp.register_comm_hook(None, bfloat16_wire_hook)
        return ddp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    names = ("shard",) if len(arg) == 1 else ("replicate", "shard")
    mesh = init_device_mesh("cpu", arg, mesh_dim_names=names)
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 if bf16 else None)
    for block in stage.blocks.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(stage, mesh=mesh, mp_policy=policy)


def bfloat16_wire_hook(_state, bucket):
    """What torch's ``default_hooks.bf16_compress_hook`` does (DDP refuses that hook, by its
    name, without NCCL): the bucket cast to bfloat16 and divided by the world size,
    all-reduced, cast back."""
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    wire = buf.to(torch.bfloat16).div_(dist.get_world_size())

    def back(fut):
        return buf.copy_(fut.value()[0])

    return dist.all_reduce(wire, async_op=True).get_future().then(back)


def torch_steps(cfg, world, kind: str, arg, bf16: bool) -> dict:
    """hpctrain's training as a PyTorch loop (``common.torch_loop``) under DDP or FSDP2
    (:func:`_wrap`); rank 0's step seconds and losses."""
    from .common import torch_loop

    times, losses = torch_loop(cfg, world, wrap=lambda stage: _wrap(stage, kind, arg, bf16))
    return {"step_s": times, "comm_s": [{} for _ in times], "losses": losses}


def compute_overrides(size: str) -> list[str]:
    """One rank alone on a quarter of the global batch: the same microbatches per rank."""
    g = next(int(x.split("=")[1]) for x in MODEL[size] if x.startswith("train.global_batch"))
    return [f"train.global_batch_size={g // 4}", "topology.dp=1"]


class Peers:
    """The torch peers among ``names``, trained by :func:`torch_peers.run` in one child
    process per rank when a repeat reaches the first of them, in the order that repeat runs
    them (they stand together in :func:`variant_names`; every other repeat reverses it)."""

    def __init__(self, world, size: str, names: list[str]):
        self.world, self.size = world, size
        self.names, self.done = [n for n in names if n in TORCH], {}

    def __call__(self, name: str) -> dict | None:
        from . import torch_peers

        if name not in self.done:
            order = self.names if name == self.names[0] else self.names[::-1]
            self.done = torch_peers.run(self.world, self.size, order) or dict.fromkeys(order)
        return self.done.pop(name)


def one(world, solo, name: str, size: str, peers: Peers) -> dict | None:
    if name in TORCH:
        return peers(name)
    if name == "compute":
        return train_once(world, solo, [*MODEL[size], *compute_overrides(size)], size)
    extra = NAIVE if name == "naive baseline" else hpctrain_variants()[name]
    return train_once(world, world, [*MODEL[size], *extra], size)


def main(argv=None) -> int:
    from hpctrain import comm

    args = worker_args("python -m benchmarks.nodes_worker", argv)
    world = comm.world()
    solo = comm.split(world, world.rank, 0, "bench-solo")
    description = calibrated(world, args.size)
    names = variant_names(args.size)
    peers = Peers(world, args.size, names)
    interleave(world, names, args.repeats,
               lambda n: one(world, solo, n, args.size, peers), args.out, "nodes",
               {CALIBRATED: description})
    return 0


CALIBRATED = "plan --calibrate"  # the samples' key of the description measured here


def calibrated(world, size: str) -> str | None:
    """``hpctrain plan --calibrate`` of the benchmark's model on these nodes, before the
    variants: the description the plan's predictions use (TOML, rank 0; None elsewhere).
    Collective."""
    from hpctrain.planner.calibrate import calibrate
    from hpctrain.planner.cluster import dumps, load

    from .common import train_config
    from .nodes import DESCRIPTION

    cfg = train_config(size, *MODEL[size], *DP4)
    c = calibrate(cfg, load(str(DESCRIPTION)), "nodes-calibrated")
    return dumps(c) if c is not None else None


if __name__ == "__main__":
    from hpctrain.__main__ import finish

    finish(main())
