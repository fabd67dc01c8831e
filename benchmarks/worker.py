"""Rank-side entry of the benchmarks (``python -m benchmarks`` launches it under mpirun):

    mpirun -n N python -m mpi4py -m benchmarks.worker NAME [NAME ...] --size tiny \
        --repeats 3 --out DIR

runs the named benchmarks one after another in the same processes (one launch per world
size) and writes ``DIR/NAME_nN.json`` from rank 0 as each finishes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import time
from pathlib import Path

from . import BENCHES, SIZES, module


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.worker")
    p.add_argument("names", nargs="+", choices=sorted(BENCHES), metavar="NAME")
    p.add_argument("--size", choices=SIZES, default="tiny")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    stop_cleanly()
    from hpctrain import comm

    world = comm.world()
    from .common import loadavg

    for name in args.names:
        t0 = time.perf_counter()
        before = loadavg()
        part = importlib.import_module(f".{module(name)}", __package__)
        res = part.run(world, args.size, args.repeats)
        if world.rank == 0:
            res["wall_s"] = time.perf_counter() - t0
            res["load"] = {"before": before, "after": loadavg()}
            Path(args.out).mkdir(parents=True, exist_ok=True)
            with open(Path(args.out) / f"{name}_n{world.size}.json", "w") as f:
                json.dump(res, f, indent=1)
    return 0


def stop_cleanly() -> None:
    """SIGTERM (the driver stopping a part past its budget) ends this process through
    SystemExit, so that a part's ``finally`` runs: the simulated cluster it made is taken
    down, with the ranks it started there, which are not in the driver's process group."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


if __name__ == "__main__":
    from hpctrain.__main__ import finish

    finish(main())
