"""The matmul probe taken at start: the best FLOP/s this process reaches (``matmul_tflops``)."""

from __future__ import annotations

import math
import time

import torch


def measure_peak_flops(dtype: torch.dtype, device: str = "cpu", seconds: float = 0.3) -> float:
    """Best FLOP/s of square matrix multiplies in ``dtype`` on ``device`` (the probe taken at
    start, reported as ``matmul_tflops``). Local to this process, no communication."""
    n = 2048 if device == "cuda" else 384
    g = torch.Generator(device=device).manual_seed(0)  # the run's RNG stream is not drawn on
    a = torch.randn(n, n, dtype=dtype, device=device, generator=g)
    b = torch.randn(n, n, dtype=dtype, device=device, generator=g)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a @ b  # warm-up (kernel selection, page faults)
    sync()
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        sync()
        dt = time.perf_counter() - t0
        best = max(best, 4 * 2 * n**3 / dt)
    return best if math.isfinite(best) and best > 0 else float("nan")
