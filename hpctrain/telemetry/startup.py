"""Where a run's start-up goes: seconds from the launch to the end of the first step, by phase
(``startup_s`` in the first logged step's record, one line in the log; docs/telemetry.md).
No MPI.

Phases run from the process's start (the kernel's record of it, ``/proc/self/stat``; without
``/proc``, or for a later run in the same process, from the first mark) to each mark in turn:
``hpctrain train`` notes ``python`` (the interpreter and the command line), ``mpi`` (MPI's
initialisation), ``checks`` (the config and its inputs) and ``torch`` (importing torch and the
trainer) with :func:`note`; the loop marks ``entry``, then setup's phases and ``first_step``.
``launch``, given the launcher's start (``hpctrain launch`` exports it:
``job.launch.LAUNCHED_AT``), runs from there to the process's start.
"""

from __future__ import annotations

import os
import time


def process_start() -> float | None:
    """This process's start in epoch seconds (Linux ``/proc``, 10 ms), or None."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


_EARLY: list[tuple[str, float]] = []  # phases noted before the run's Startup exists
_FIRST = [True]  # the process's first run: its phases start at the process's start


def note(phase: str) -> None:
    """``phase`` ends now, before the run's :class:`Startup` is made (the command line)."""
    _EARLY.append((phase, time.time()))


class Startup:
    """The ends of the start-up phases of this rank (epoch seconds)."""

    def __init__(self, launched: float | None = None):
        self.launched = launched  # the launcher's start (epoch seconds), when known
        self.marks: list[tuple[str, float]] = list(_EARLY)
        _EARLY.clear()
        # a later run in the same process (the Python API) starts at its first mark
        self.from_process, _FIRST[0] = _FIRST[0], False

    def mark(self, phase: str) -> None:
        """``phase`` ends now."""
        self.marks.append((phase, time.time()))

    def phases(self) -> dict[str, float]:
        """Seconds per phase, in order (``launch`` and ``imports`` when known)."""
        out, start = {}, process_start() if self.from_process else None
        if self.launched is not None and start is not None:
            out["launch"] = max(0.0, start - self.launched)
        prev = start
        for phase, t in self.marks:
            if prev is not None:
                out[phase] = t - prev
            prev = t
        return out


def report(per_rank: list[dict]) -> tuple[dict, str]:
    """The slowest rank's seconds per phase (every rank's dict from :meth:`Startup.phases`)
    and the log line: the total, then each phase."""
    slowest = {k: round(max(d.get(k, 0.0) for d in per_rank), 3) for k in per_rank[0]}
    parts = ", ".join(f"{k} {v:.2f}" for k, v in slowest.items())
    return slowest, (f"start-up to the end of the first step: {sum(slowest.values()):.1f} s "
                     f"(slowest rank per phase, s: {parts})")
