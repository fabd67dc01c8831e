"""``python -m benchmarks.prepare_ranks [--corpus-mb 4] [--vocab-size 4096] [--repeats 3]``:
wall time of ``hpctrain prepare --tokenizer`` on the embedded corpus at 1, 2 and 4 ranks
(whole commands under mpirun, start-up included), interleaved (1, 2, 4, 1, 2, 4, ...), with
median, spread and the ratio to one rank, the load average before and after, and whether
every file had the same bytes. Standalone (not part of ``make bench``); docs/data.md."""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from hpctrain.job.launch import ROOT, command, launch_env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-mb", type=float, default=4.0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ranks", default="1,2,4")
    args = p.parse_args(argv)
    ranks = [int(r) for r in args.ranks.split(",")]
    env = {**os.environ, **launch_env(), "PYTHONPATH": str(ROOT)}
    py = sys.executable
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tok = Path(tmp) / "tok.json"
        t0 = time.perf_counter()
        subprocess.run([py, "-m", "hpctrain", "tokenizer", "train", "--embedded", "--corpus-mb",
                        str(args.corpus_mb), "--vocab-size", str(args.vocab_size), "--out",
                        str(tok)], check=True, env=env, cwd=ROOT, capture_output=True)
        train_s = time.perf_counter() - t0
        times: dict[int, list[float]] = {n: [] for n in ranks}
        digests = set()
        for _ in range(args.repeats):
            for n in ranks:
                out = Path(tmp) / f"d{n}.h5"
                cmd = command(n, py, "-m", "mpi4py", "-m", "hpctrain", "prepare", "--tokenizer",
                              str(tok), "--corpus-mb", str(args.corpus_mb), "--out", str(out))
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
                times[n].append(time.perf_counter() - t0)
                digests.add(hashlib.sha256(out.read_bytes()).hexdigest())
    load1 = os.getloadavg()
    print(f"# prepare --tokenizer, embedded corpus {args.corpus_mb:g} MB, vocabulary "
          f"{args.vocab_size}, {args.repeats} interleaved repeats, "
          f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, "
          f"load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    print(f"tokenizer train (one process): {train_s:.2f} s")
    base = statistics.median(times[ranks[0]])
    for n in ranks:
        med = statistics.median(times[n])
        print(f"{n} rank(s): median {med:.2f} s (min {min(times[n]):.2f}, max "
              f"{max(times[n]):.2f}); {base / med:.2f}x of {ranks[0]} rank(s)")
    print(f"identical files: {len(digests) == 1} ({len(digests)} distinct)")
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
