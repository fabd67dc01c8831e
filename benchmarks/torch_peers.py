"""PyTorch's peers of :mod:`benchmarks.nodes_worker` in processes of their own, as
``torchrun`` would start them: each MPI rank starts one child per batch of peers and waits for
it (blocked in ``waitpid``, not spinning), the child joins a gloo group over the nodes' links,
trains every peer of the batch in order and exits, its gloo threads with it.

Why not in the MPI ranks themselves: a rank that has run gloo keeps gloo's socket threads for
the rest of the process, and hpctrain's variants run after it in that rank then stalled for
1.6-36 s a step on this 2-core machine (4 ranks yielding to each other while the kernel ran
the extra threads; never before the first torch variant, never in a run without torch). A
user's hpctrain job never carries gloo, so the ranks that time hpctrain carry none either.

    python -m benchmarks.torch_peers --size small --names '["DDP 4 MB, fp32"]' --out F.json

with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME`` set
by :func:`run` (rank 0 writes ``{name: {"step_s", "comm_s", "losses"}}``).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace


def my_address() -> tuple[str, str]:
    """This node's address and interface for gloo: eth0's inside the simulated cluster (a
    UDP connect to the hub sends nothing), else loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.213.0.254", 9))
            return s.getsockname()[0], "eth0"
    except OSError:
        return "127.0.0.1", "lo"


TRIES = 2  # a batch whose child failed on any rank runs again once, on a fresh port
LIMIT_S = 600  # a child still running after this is killed (its peers' gloo gave up)


def run(world, size: str, names: list[str]) -> dict | None:
    """Train the torch peers ``names`` (keys of ``nodes_worker.TORCH``) in one child process
    per rank; rank 0's results by name (None elsewhere). Collective over ``world``: rank 0
    picks the rendezvous address and a free port, every rank waits for its child; where a
    child fails on any rank, every rank tries again (:data:`TRIES`), then raises with the
    failed child's last lines."""
    for attempt in range(1, TRIES + 1):
        code, err, res = _attempt(world, size, names)
        if world.allreduce(float(code != 0), "max") == 0:
            return res
        if code != 0:
            print(f"[torch_peers] rank {world.rank}, try {attempt}: exit {code}\n{err}",
                  file=sys.stderr, flush=True)
    raise RuntimeError(f"torch peers {names} failed {TRIES} times (rank {world.rank}: exit "
                       f"{code}): {err[-1500:]}")


def _attempt(world, size: str, names: list[str]) -> tuple[int, str, dict | None]:
    """One child per rank: its exit code, its stderr's end, rank 0's results."""
    mine, iface = my_address()
    if world.rank == 0:
        with socket.socket() as s:
            s.bind((mine, 0))
            port = s.getsockname()[1]
    addr, port = world.bcast_obj((mine, port) if world.rank == 0 else None)
    env = {**os.environ, "RANK": str(world.rank), "WORLD_SIZE": str(world.size),
           "MASTER_ADDR": addr, "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": iface}
    with tempfile.TemporaryDirectory(prefix="hpct-peers-") as d:
        out = Path(d) / "peers.json"
        cmd = [sys.executable, "-m", "benchmarks.torch_peers", "--size", size,
               "--names", json.dumps(names), "--out", str(out)]
        try:
            proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, timeout=LIMIT_S)
        except subprocess.TimeoutExpired as e:
            return -9, f"killed after {LIMIT_S} s: {e.stderr or ''}"[-3000:], None
        ok = proc.returncode == 0 and (world.rank != 0 or out.exists())
        res = json.loads(out.read_text()) if ok and world.rank == 0 else None
        return (0 if ok else proc.returncode or 1), proc.stderr[-3000:], res


def main(argv=None) -> int:
    import argparse

    import mpi4py  # the child is no MPI process: hpctrain's imports must not start MPI

    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    import torch.distributed as dist

    from .cluster_worker import MODEL
    from .common import train_config
    from .nodes_worker import TORCH, torch_steps

    p = argparse.ArgumentParser(prog="python -m benchmarks.torch_peers")
    p.add_argument("--size", required=True)
    p.add_argument("--names", required=True, help="JSON list of nodes_worker.TORCH keys")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=LIMIT_S // 4))
    cfg = train_config(a.size, *MODEL[a.size])
    world = SimpleNamespace(rank=rank, size=size)
    res = {n: torch_steps(cfg, world, *TORCH[n]) for n in json.loads(a.names)}
    dist.barrier()  # every rank done with every peer before the group goes
    dist.destroy_process_group()
    if rank == 0:
        Path(a.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
