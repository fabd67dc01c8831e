"""Evidence of each step: timers, ``metrics.jsonl``, the progress line and the run log.

:class:`Timers` (exclusive seconds per category), :class:`RunLog` (rank 0 writes
``RUN_DIR/metrics.jsonl``, one JSON object per step, and ``RUN_DIR/train.log``, and prints the
progress line) and :class:`Telemetry`, which the loop drives: step-time breakdown, MFU
(``planner/flops.py``, handed in), the straggler report, the trace (``trace.py``) and the watchdog
(``watchdog.py``). Numbers compared across ranks are reduced first.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from ..config import dumps_toml


class Timers:
    """Wall-clock seconds per category for the current step (``with timers("data"):``).

    Times are *exclusive*: a category nested in another is subtracted from its parent, and
    communication waits recorded by ``recorder`` (the run's ``comm.Recorder``) inside a category
    are subtracted too
    (they are reported per axis), so the categories, the exposed communication and ``other``
    add up to the step time. ``current`` names the innermost open category (the watchdog
    reports it). ``listeners`` get ``(kind, name, t0, t1)`` on every close (the tracer);
    ``kind`` is ``"phase"`` for categories and ``"action"`` for :meth:`action` spans.
    ``sync`` (e.g. ``torch.cuda.synchronize``) runs at both ends of a category so that
    asynchronous GPU work is charged to the category that queued it (not to actions).
    """

    def __init__(self, sync=None, recorder=None):
        self.sync = sync
        self.recorder = recorder
        self.seconds: dict[str, float] = defaultdict(float)
        self.listeners: list = []
        self._stack: list[list] = []  # [name, child seconds, child comm seconds]

    @property
    def current(self) -> str:
        """Innermost open category; safe to read from another thread (the watchdog)."""
        try:
            return self._stack[-1][0]
        except IndexError:
            return "-"

    @contextmanager
    def __call__(self, name: str):
        if self.sync is not None:
            self.sync()
        t0, c0 = time.perf_counter(), self._exposed_comm()
        frame = [name, 0.0, 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            t1, c1 = time.perf_counter(), self._exposed_comm()
            self._stack.pop()
            total, comm_s = t1 - t0, c1 - c0
            self.seconds[name] += total - frame[1] - (comm_s - frame[2])
            if self._stack:
                self._stack[-1][1] += total
                self._stack[-1][2] += comm_s
            for fn in self.listeners:
                fn("phase", name, t0, t1)

    def add(self, name: str, seconds: float) -> None:
        """Account ``seconds`` measured elsewhere (e.g. pipeline bubble) to ``name``; taken
        out of the enclosing category so nothing is counted twice."""
        self.seconds[name] += seconds
        if self._stack:
            self._stack[-1][1] += seconds

    @contextmanager
    def action(self, name: str):
        """A schedule action (``F3``, ``B3``...): traced, not a category of its own."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            for fn in self.listeners:
                fn("action", name, t0, t1)

    def take(self) -> dict[str, float]:
        out = dict(self.seconds)
        self.seconds.clear()
        return out

    def _exposed_comm(self) -> float:
        return sum(self.recorder.exposed_s.values()) if self.recorder is not None else 0.0


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _fmt_mfu(mfu: float | None) -> str:
    return "-" if mfu is None else f"{mfu:.2%}"


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

    def continue_at(self, step: int, folder: str) -> None:
        """The run starts after ``step`` (0: a fresh start): records of later steps in
        ``metrics.jsonl`` (an abandoned trajectory, or steps redone after a crash) move to
        ``RUN_DIR/abandoned/<folder>/metrics.jsonl``, so the file holds one trajectory
        (rank 0; logged)."""
        path = self.dir / "metrics.jsonl"
        if not self.is_writer or not path.is_file():
            return
        keep, later = [], []
        for line in path.read_text().splitlines(keepends=True):
            try:
                done = int(json.loads(line)["step"]) <= step
            except (ValueError, KeyError, TypeError):
                done = False  # a torn line
            (keep if done else later).append(line)
        if not later:
            return
        aside, n = self.dir / "abandoned" / folder, 1
        while (aside / "metrics.jsonl").exists():  # never over records set aside before
            n += 1
            aside = self.dir / "abandoned" / f"{folder}-{n}"
        aside.mkdir(parents=True, exist_ok=True)
        (aside / "metrics.jsonl").write_text("".join(later))
        self._metrics.close()
        tmp = self.dir / ".metrics.jsonl.tmp"
        tmp.write_text("".join(keep))
        tmp.replace(path)
        self._metrics = open(path, "a", buffering=1)
        self.info(f"{len(later)} record(s) of metrics.jsonl after step {step} set aside in "
                  f"{aside / 'metrics.jsonl'}")

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
        if logging_step(step, self.every, self.total):
            mean = self._time_sum / self._steps_timed
            eta = (self.total - step) * mean
            line = (f"step {step}/{self.total} | loss {record['loss']:.4f} | "
                    f"lr {record['lr']:.2e} | gnorm {record['grad_norm']:.3f} | "
                    f"{record['tokens_per_s']:,.0f} tok/s | step {record['step_time_s']:.3f} s "
                    f"| MFU {_fmt_mfu(record.get('mfu'))} | ETA {_fmt_eta(eta)}")
            self.info(line)

    def close(self) -> None:
        if self.is_writer:
            self._metrics.close()
            self._log.close()


def logging_step(step: int, every: int, total: int) -> bool:
    """Every ``train.log_every``-th step and the last: the progress line and the metrics
    that need collectives."""
    return step % every == 0 or step == total


class Telemetry:
    """Everything one rank measures about its steps, in one object for the loop:

    - ``timers`` (exclusive seconds per category) and ``topo.recorder`` (exposed seconds and
      bytes per axis) become ``time_s`` in each step record: categories, ``comm_<axis>`` and
      ``other``, which add up to ``step_time_s`` on this rank;
    - throughput: ``tokens_per_s``, model ``flops_per_token`` (:mod:`hpctrain.planner.flops`),
      ``tflops_per_rank`` (achieved) and ``mfu``: achieved over the nominal peak ``peak``
      (``telemetry.peak_flops`` or the cluster description's, named in ``peak_source``;
      none: no ``mfu``), and ``matmul_tflops``, the matmul rate a probe achieved at start
      (the median over nodes), reported apart;
    - the trackers (:mod:`.tracking`: TensorBoard, offline W&B) on rank 0;
    - every ``log_every`` steps a straggler report reduced over the world: min/median/max
      step time, and the slowest rank, judged by *busy* time (step time minus exposed
      communication and pipeline bubble: in a synchronous step every rank's wall time is the
      same, the slow one is the one the others wait for), with its grid coordinates;
    - optionally a :class:`~.trace.Tracer` and a :class:`~.watchdog.Watchdog`.

    Construction, :meth:`end_step` at log intervals and :meth:`close` are collective over
    ``topo.world``.
    """

    def __init__(self, cfg, topo, run_dir: str | Path, log: RunLog,
                 peak: tuple[float | None, str] = (None, ""), lineage: dict | None = None,
                 *, flops_per_token: float):
        from ..model.stage import DTYPES
        from .peak import measure_peak_flops

        tc, t, m = cfg.telemetry, cfg.train, cfg.model
        self.topo, self.log, self.run_dir = topo, log, Path(run_dir)
        self.timers = Timers(sync=torch.cuda.synchronize if m.device == "cuda" else None,
                            recorder=topo.recorder)
        self.every = max(1, t.log_every)
        self.total = t.steps
        self.tokens = t.global_batch_size * t.seq_len
        self.flops_per_token = flops_per_token
        # One probe per node (its first rank), while the node's other ranks wait: probes
        # running at once on shared cores would each measure a fraction of the device.
        probe = (measure_peak_flops(DTYPES[m.dtype], m.device) if topo.local_rank == 0
                 else None)
        rows = topo.world.allgather_obj((f"rank {topo.world.rank} {topo.coords}", probe))
        self.names = [name for name, _ in rows]
        self.matmul = _median(sorted(p for _, p in rows if p is not None))
        self.peak, self.peak_source = peak  # MFU's denominator: a nominal peak, or none
        from .tracking import Trackers

        self.trackers = Trackers(cfg, self.run_dir, dumps_toml(cfg), lineage or {},
                                 log.is_writer)
        # The first record of this run says on which layout it ran (report: layout changes).
        self.run_start: dict | None = {"layout": _layout(topo.dims), "world_size": topo.world.size,
                                       "resumed_from": (lineage or {}).get("resumed_from")}
        self.window: list[tuple[float, float]] = []  # (step_s, busy_s) since the last report
        self.tracer = self.watchdog = None
        if tc.trace:
            from .trace import Tracer

            self.tracer = Tracer(tc.trace_steps, topo, self.run_dir, self.timers)
        if tc.watchdog_s > 0:
            from .watchdog import Watchdog

            self.watchdog = Watchdog(tc.watchdog_s, topo, self.run_dir, self.timers,
                                     tc.watchdog_factor, t.eval_batches if t.eval_every else 1)
        dog = (f"max({tc.watchdog_s:g} s, {tc.watchdog_factor:g} x slowest step)"
               if tc.watchdog_factor else f"{tc.watchdog_s:g} s")
        mfu = (f"MFU against {self.peak / 1e12:.4g} TFLOP/s per rank ({self.peak_source})"
               if self.peak else f"MFU not computed ({self.peak_source})")
        log.info(f"model {self.flops_per_token / 1e6:,.2f} MFLOP/token (train), {mfu}, "
                 f"matmul probe {self.matmul / 1e12:.3g} TFLOP/s per rank"
                 + (f", watchdog {dog}" if self.watchdog else ", watchdog off")
                 + (f", trace steps {tc.trace_steps}" if self.tracer else ""))

    def logs(self, step: int) -> bool:
        """Whether step ``step`` (1-based) is a logging step: its record carries what ranks
        must exchange to know (stragglers, pipeline and MoE statistics)."""
        return logging_step(step, self.every, self.total)

    def begin_step(self, step: int) -> None:
        """``step`` is 1-based, as in ``metrics.jsonl``. Not collective. What was timed or
        communicated since the last step ended (set-up, restore, the node's FLOP/s probe) is
        in no step's time: dropped, so that a step's categories add up to its time."""
        self.topo.recorder.take()
        self.timers.take()
        if self.tracer:
            self.tracer.begin_step(step)
        if self.watchdog:
            self.watchdog.begin_step(step)

    def end_step(self, record: dict) -> dict:
        """Complete ``record`` (needs ``step`` and ``step_time_s``) with the breakdown,
        throughput and, every ``log_every`` steps, the straggler report; write it (rank 0).
        Collective over the world at log intervals."""
        if self.tracer:
            self.tracer.end_step()
        step_s = record["step_time_s"]
        if self.watchdog:
            self.watchdog.end_step(step_s)
        comm_s, comm_bytes = self.topo.recorder.take()
        phases = self.timers.take()
        # The pipeline runner's per-action detail (pp_F, pp_idle...) lies inside 'compute'
        # and its waits inside comm_pp: kept apart so that the categories add up.
        pipeline = {k: phases.pop(k) for k in list(phases) if k.startswith("pp_")}
        breakdown = {**phases, **{f"comm_{a}": s for a, s in comm_s.items()}}
        breakdown["other"] = max(0.0, step_s - sum(breakdown.values()))
        busy = step_s - sum(comm_s.values()) - phases.get("bubble", 0.0)
        if pipeline:
            record["pipeline_s"] = pipeline
        achieved = self.flops_per_token * self.tokens / step_s / self.topo.world.size
        record.update(tokens_per_s=self.tokens / step_s, time_s=breakdown, busy_s=busy,
                      comm_s=comm_s,
                      comm_bytes=comm_bytes, flops_per_token=self.flops_per_token,
                      tflops_per_rank=achieved / 1e12, matmul_tflops=self.matmul / 1e12,
                      peak_source=self.peak_source)
        if self.peak:
            record["mfu"] = achieved / self.peak
        if self.run_start is not None:
            record["run_start"], self.run_start = self.run_start, None
        self.window.append((step_s, busy))
        if self.logs(record["step"]):
            record.update(self._stragglers())
        self.log.step(record)
        self.trackers.log(record)
        if "straggler" in record and self.topo.world.size > 1:
            s = record["straggler"]
            self.log.info(f"  per-rank mean step since the last line, min/median/max "
                          f"{record['step_s_min']:.3f}/"
                          f"{record['step_s_median']:.3f}/{record['step_s_max']:.3f} s | "
                          f"slowest {s['name']}: busy {s['busy_s']:.3f} s (median "
                          f"{s['median_busy_s']:.3f} s, fastest {s['min_busy_s']:.3f} s)")
        return record

    def _stragglers(self) -> dict:
        """Mean step and busy seconds per rank over the window, gathered (world)."""
        n = len(self.window)
        mine = (sum(w[0] for w in self.window) / n, sum(w[1] for w in self.window) / n)
        self.window.clear()
        every = self.topo.world.allgather_obj(mine)
        steps = sorted(s for s, _ in every)
        busy = [b for _, b in every]
        slow = max(range(len(busy)), key=busy.__getitem__)
        return {"step_s_min": steps[0], "step_s_median": _median(steps),
                "step_s_max": steps[-1],
                "ranks": {"step_s": [s for s, _ in every], "busy_s": busy},
                "straggler": {"rank": slow, "name": self.names[slow], "busy_s": busy[slow],
                              "median_busy_s": _median(sorted(busy)),
                              "min_busy_s": min(busy)}}

    def close(self) -> None:
        """Merge the trace (collective over the world, still watched), then stop the
        watchdog (also when the merge fails)."""
        try:
            if self.tracer:
                path = self.tracer.close()
                if path:
                    self.log.info(f"trace: {path} (open in Perfetto)")
        finally:
            self.trackers.close()
            if self.watchdog:
                self.watchdog.close()


def _layout(dims) -> str:
    """``pp=1 dp=2 ep=1 cp=1 tp=2`` from the grid dims (pp, dp_outer, ep, cp, tp)."""
    pp, dp_outer, ep, cp, tp = dims
    return f"pp={pp} dp={dp_outer * ep} ep={ep} cp={cp} tp={tp}"


def _median(sorted_values: list[float]) -> float:
    n = len(sorted_values)
    mid = n // 2
    return sorted_values[mid] if n % 2 else 0.5 * (sorted_values[mid - 1] + sorted_values[mid])
