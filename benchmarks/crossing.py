"""What crosses a node's link in one gradient all-reduce, by design: flat (one all-reduce of
every byte), hierarchical (``grad_sync.buckets.reduce_hierarchical``: reduce-scatter in the
node, all-reduce across, all-gather in the node) and per-parameter (67 all-reduces, the
naive baseline's). For each, the median time over interleaved repeats and the bytes this
node's interface sent (``/proc/net/dev``, read by local rank 0: inside a simulated node it
counts that node's traffic alone), as a multiple of the message. Run on 2 simulated nodes::

    scripts/cluster.sh with x 2 2 200mbit -- scripts/cluster.sh mpirun x -n 4 \\
        .venv/bin/python -m benchmarks.crossing --mb 14

(14 MB: the nodes part's float32 gradients.) A design sends fewer bytes across than another
only where the interface counters say so; where they are equal, only hiding compute can
make one faster.
"""

from __future__ import annotations

import argparse
import time

import torch

from .common import interleaved, loadavg, median

PER_PARAMETER = 67  # the nodes part's model: 67 gradient tensors


def sent_bytes(interface: str = "eth0") -> int:
    """Bytes ``interface`` of this network namespace has sent (0 when it has none)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == interface:
                return int(counters.split()[8])
    return 0


def designs(world, x: torch.Tensor, node_color: int | None = None) -> dict:
    """name -> a callable summing ``x`` in place over ``world`` that way (``node_color``
    pretends nodes, as ``build_hierarchy`` does). Collective."""
    from hpctrain.parallel.grad_sync.buckets import build_hierarchy, reduce_hierarchical

    h = build_hierarchy(world, node_color)
    chunks = torch.chunk(x, PER_PARAMETER)

    def per_parameter():
        for c in chunks:
            world.allreduce_(c)

    return {"flat": lambda: world.allreduce_(x),
            "hierarchical": lambda: reduce_hierarchical(h, x),
            f"per-parameter ({PER_PARAMETER})": per_parameter}


def measure(world, nbytes: int, repeats: int) -> list[dict]:
    """Every design ``repeats`` times, interleaved; rows of median seconds and the bytes
    the busiest node sent per call. Collective."""
    from hpctrain import comm

    node = comm.node_local(world)
    x = torch.ones(max(PER_PARAMETER, nbytes // 4))

    def sampled(run):
        def sample() -> tuple[float, float]:  # (slowest rank's seconds, busiest node's bytes)
            world.barrier()
            before, t0 = sent_bytes(), time.perf_counter()
            run()
            dt = time.perf_counter() - t0
            world.barrier()
            mine = sent_bytes() - before if node.rank == 0 else 0
            return world.allreduce(dt, "max"), world.allreduce(float(mine), "max")
        return sample

    samples = interleaved({k: sampled(run) for k, run in designs(world, x).items()}, repeats)
    message = x.numel() * x.element_size()
    return [{"design": k, "median_s": median([t for t, _ in s]),
             "sent_bytes": median([b for _, b in s]), "message_bytes": message}
            for k, s in samples.items()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.crossing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=14.0, help="message size, MB")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    from hpctrain import comm

    world = comm.world()
    rows = measure(world, int(args.mb * 1e6), args.repeats)
    if world.rank == 0:
        print(f"{world.size} ranks, {args.mb:g} MB, {args.repeats} repeats, load "
              f"{loadavg()[0]}")
        for r in rows:
            rate = r["sent_bytes"] / r["median_s"] / 1e6
            print(f"{r['design']:20s} {r['median_s'] * 1e3:8.1f} ms   node sent "
                  f"{r['sent_bytes'] / 1e6:7.2f} MB = {r['sent_bytes'] / r['message_bytes']:.2f}"
                  f" x the message   {rate:5.1f} MB/s", flush=True)
    return 0


if __name__ == "__main__":
    from hpctrain.__main__ import finish

    finish(main())
