"""Per-rank trace of the steps in a window, merged into one Chrome-trace ``trace.json``.

Each rank records complete events (``"ph": "X"``, microseconds) for
  - every timer category (``data``, ``compute``, ``grad_sync``...; thread "phases"),
  - every schedule action the runner wraps in ``timers.action("F3")`` (thread "schedule"),
  - every communication, posted -> completed, with bytes, axis and peer (one thread per axis),
  - the step itself (thread "phases", name ``step N``),
for the steps in ``telemetry.trace_steps`` ("A-B", 1-based like ``metrics.jsonl``). At the end
each rank writes ``RUN_DIR/trace/rank<R>.json`` and world rank 0 merges them into
``RUN_DIR/trace.json`` (open it in Perfetto or chrome://tracing): one process per rank,
named with its grid coordinates.

Clocks: every rank takes its time origin right after a world barrier, so timestamps agree
across ranks up to the barrier's exit skew (microseconds on one node).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..config import trace_window as parse_window  # the key's form, checked with the config

THREADS = {"phases": 0, "schedule": 1}  # comm axes follow from 2


class Tracer:
    """Records this rank's events in the step window. Construction and :meth:`close` are
    collective over ``topo.world`` (a barrier each)."""

    def __init__(self, window: str, topo, run_dir: Path, timers):
        self.lo, self.hi = parse_window(window)
        self.topo, self.dir = topo, Path(run_dir)
        self.rank = topo.world.rank
        self.events: list[dict] = []
        self.active = False
        self._step, self._step_t0 = 0, 0.0
        self._threads = dict(THREADS)
        self.topo.recorder.listeners.append(self._on_comm)
        timers.listeners.append(self._on_timer)
        topo.world.barrier()
        self.t0 = time.perf_counter()

    def _us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 3)

    def _tid(self, name: str) -> int:
        return self._threads.setdefault(name, len(self._threads))

    def _add(self, name: str, cat: str, thread: str, t0: float, t1: float, **args) -> None:
        self.events.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank,
                            "tid": self._tid(thread), "ts": self._us(t0),
                            "dur": round(max(t1 - t0, 0.0) * 1e6, 3),
                            "args": {"step": self._step, **args}})

    def begin_step(self, step: int) -> None:
        self.active = self.lo <= step <= self.hi
        self._step, self._step_t0 = step, time.perf_counter()

    def end_step(self) -> None:
        if self.active:
            self._add(f"step {self._step}", "step", "phases", self._step_t0, time.perf_counter())
        self.active = False

    def _on_timer(self, kind: str, name: str, t0: float, t1: float) -> None:
        if self.active:
            self._add(name, kind, "phases" if kind == "phase" else "schedule", t0, t1)

    def _on_comm(self, rec) -> None:
        if self.active:
            self._add(rec.op, "comm", f"comm {rec.axis}", rec.posted, rec.completed,
                      axis=rec.axis, bytes=rec.nbytes, peer=rec.peer)

    def close(self) -> Path | None:
        """Write this rank's part; world rank 0 merges all parts into ``trace.json``.
        Collective over ``topo.world``. Returns the merged path on rank 0."""
        self.topo.recorder.listeners.remove(self._on_comm)
        parts = self.dir / "trace"
        if self.rank == 0:
            parts.mkdir(parents=True, exist_ok=True)
        self.topo.world.barrier()
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank,
                 "args": {"name": f"rank {self.rank} {self.topo.coords}"}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                  "args": {"name": name}} for name, tid in self._threads.items()]
        (parts / f"rank{self.rank}.json").write_text(json.dumps(meta + self.events))
        self.topo.world.barrier()
        if self.rank != 0:
            return None
        events = []
        for r in range(self.topo.world.size):
            part = parts / f"rank{r}.json"
            events += json.loads(part.read_text())
            part.unlink()
        parts.rmdir()
        out = self.dir / "trace.json"
        out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return out
