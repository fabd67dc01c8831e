"""Evidence of every stage: what a step used, changed and cost, and why a run stopped.

- ``metrics.py``: :class:`Timers` (exclusive seconds per category), :class:`RunLog`
  (metrics.jsonl, train.log), :class:`Telemetry` (step breakdown, MFU, stragglers).
- ``trace.py``: the Chrome/Perfetto trace of phases, schedule actions and communication.
- ``watchdog.py``: a stuck rank ends the job, naming the rank, its coordinates and the op.
- ``flops.py``: model FLOPs per token and the matmul probe (``matmul_tflops``).
- ``tracking.py``: TensorBoard event files and an offline W&B run (rank 0, optional).
- ``summary.py``: the end-of-run summary (``summary.json``).
- ``memory.py``: the plan's memory estimate and the measured meter.
- ``fault_injection.py``: faults for tests (kill, stall, poison, slow, raise).
- ``startup.py``: where the start-up goes, phase by phase (standard library only).

The names below load their modules when first asked for, so that ``startup.py`` is imported
without torch or MPI.
"""

import importlib

_HOMES = {"Faults": ".fault_injection", "Meter": ".meter", "RunLog": ".metrics",
          "Telemetry": ".metrics", "Timers": ".metrics"}

__all__ = list(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name], __name__), name)
