"""Evidence of each step: timers, ``metrics.jsonl``, the progress line and the run log.

Rank 0 writes ``RUN_DIR/metrics.jsonl`` (one JSON object per step) and ``RUN_DIR/train.log``
and prints the progress line; the numbers it writes are reduced over the world first.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path


class Timers:
    """Wall-clock seconds per category for the current step (``with timers("data"):``)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class RunLog:
    """metrics.jsonl + train.log + stdout progress, written by world rank 0 only."""

    def __init__(self, run_dir: str | Path, topo, total_steps: int, log_every: int = 1):
        self.dir = Path(run_dir)
        self.topo = topo
        self.is_writer = topo.world.rank == 0
        self.total = total_steps
        self.every = max(1, log_every)
        self._t_start = time.perf_counter()
        self._steps_timed = 0
        self._time_sum = 0.0
        if self.is_writer:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._metrics = open(self.dir / "metrics.jsonl", "a", buffering=1)
            self._log = open(self.dir / "train.log", "a", buffering=1)

    def info(self, msg: str) -> None:
        """A line for the log and stdout (rank 0)."""
        if self.is_writer:
            line = f"[hpctrain] {msg}"
            print(line, flush=True)
            self._log.write(time.strftime("%H:%M:%S ") + line + "\n")

    def warn(self, msg: str) -> None:
        """A warning every rank may raise; printed once per rank to stderr."""
        print(f"[hpctrain] warning (rank {self.topo.world.rank}): {msg}", file=sys.stderr,
              flush=True)

    def step(self, record: dict) -> None:
        """Write one step's metrics; print the progress line every ``log_every`` steps."""
        if not self.is_writer:
            return
        self._metrics.write(json.dumps(record) + "\n")
        step = record["step"]
        self._steps_timed += 1
        self._time_sum += record["step_time_s"]
        if step % self.every == 0 or step == self.total:
            mean = self._time_sum / self._steps_timed
            eta = (self.total - step) * mean
            line = (f"step {step}/{self.total} | loss {record['loss']:.4f} | "
                    f"lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} | "
                    f"{record['tokens_per_s']:,.0f} tok/s | {record['step_time_s']:.3f} s/step "
                    f"| ETA {_fmt_eta(eta)}")
            self.info(line)

    def close(self) -> None:
        if self.is_writer:
            self._metrics.close()
            self._log.close()
