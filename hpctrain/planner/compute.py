"""One process's compute, measured for ``plan --calibrate`` (``planner/calibrate.py``).

No MPI of its own: the hook and ring costs run over the one-rank group ``alone`` they are
handed. Every measurement interleaves what it compares (a change of this shared machine's
speed falls on both alike) and takes medians or trimmed means over repeats:

- :func:`compute_rate`: the peak of square matrix multiplies, the config's whole model
  forward + backward at 3 depths x 3 microbatch sizes (:func:`grid_times`), fitted to
  FLOPs at a rate + an overhead per layer + one per stage (:func:`fit_compute`), the
  optimizer step;
- :func:`hook_cost`, :func:`ring_cost`, :func:`split_cost`: ZeRO-2's gradient hooks, ring
  attention beyond its FLOPs, zero-bubble's B and W shares.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..config import Config
from ..telemetry.peak import measure_peak_flops
from .cost import layer_flops
from .flops import forward_flops_per_token


def _median_time(fn, repeats: int, stat=statistics.median) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return stat(out)


def whole_model(cfg: Config, layers: int = 0):
    """The config's model (its first ``layers`` blocks only, if given) as one stage."""
    from ..model import DecoderStage, init_parameters

    stage = DecoderStage(cfg.model, range(layers or cfg.model.n_layers), first=True, last=True)
    init_parameters([stage], seed=1)
    return stage


def step_seconds(stage, x, times: int = 1) -> float:
    """Seconds of ``times`` forwards + backwards of ``stage`` on the tokens ``x`` (their own
    targets), its gradients cleared first."""
    stage.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for _ in range(times):
        stage(x, x).backward()
    return time.perf_counter() - t0


def zero2_backwards(cfg: Config, group, alone, microbatches: int):
    """A timer of ``microbatches`` forwards + backwards of the whole model with ZeRO-2's
    gradient hooks (``parallel/grad_sync/sharded.py``: the staging copy, the counts, posting a
    reduce-scatter per bucket over ``group``, the tests that drive them) and the wait for
    the reductions at the end: (the timer, the model's parameter tensors). Collective over
    ``group`` (``alone``, a one-rank group: nothing travels)."""
    from types import SimpleNamespace

    from ..parallel import grad_sync

    stage = whole_model(cfg)
    named = list(stage.named_parameters())
    topo = SimpleNamespace(dpcp_comm=group, edpcp_comm=group, tp_comm=alone, tp_size=1)
    grads = grad_sync.create(named, topo, cfg.optim.bucket_mb, zero=2,
                             microbatches=microbatches, progress="test")
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len))

    def run() -> float:
        grads.zero()
        t0 = time.perf_counter()
        for _ in range(microbatches):
            stage(x, x).backward()
        grads.reduce()
        return time.perf_counter() - t0
    return run, len(named)


def compute_rate(cfg: Config, alone=None, repeats: int = 5) -> dict:
    """One process: peak FLOP/s, achieved model rate, per-layer and per-stage-pass
    overheads (:func:`fit_compute` over :func:`grid_times`), the gradient hooks' cost (over
    ``alone``, a one-rank group), the optimizer step."""
    stage = whole_model(cfg)
    x = torch.randint(0, cfg.model.vocab_size, (1, cfg.train.seq_len))
    stage(x, x).backward()  # gradients for the optimizer step below
    peak = measure_peak_flops(getattr(torch, cfg.model.dtype))
    times = grid_times(cfg, 4 * repeats)
    rate, layer, per_pass = fit_compute(cfg, times, peak)
    opt = torch.optim.AdamW(stage.parameters(), foreach=False)
    return {"peak": peak, "rate": rate, "overhead_s": layer, "pass_overhead_s": per_pass,
            "hook_overhead_s": hook_cost(cfg, alone, repeats) if alone is not None else 0.0,
            "ring_overhead_s": ring_cost(cfg, alone, repeats) if alone is not None else 0.0,
            **(split_cost(cfg, 2 * repeats) if alone is not None else {}),
            "step_overhead_s": _median_time(opt.step, repeats)}


def grid(cfg: Config) -> list[tuple[int, int]]:
    """(blocks, microbatch) of the models :func:`grid_times` times: the config's model, its
    first half and quarter of the blocks (the same ends), at B, 2B and 4B sequences."""
    L, B = cfg.model.n_layers, cfg.train.micro_batch_size
    return [(n, b) for n in sorted({L, max(1, L // 2), max(1, L // 4)}, reverse=True)
            for b in (B, 2 * B, 4 * B)]


def grid_times(cfg: Config, repeats: int) -> dict[tuple[int, int], float]:
    """Median seconds of one forward + backward for every point of :func:`grid`, the
    points interleaved round by round, so that a change of the machine's speed during the
    measurement falls on all of them alike (this host's other tenants change it within
    seconds)."""
    points = grid(cfg)
    stages = {n: whole_model(cfg, n) for n, _ in points}
    xs = {b: torch.randint(0, cfg.model.vocab_size, (b, cfg.train.seq_len)) for _, b in points}

    def once(n, b):
        return step_seconds(stages[n], xs[b])
    for p in points:
        once(*p)  # warm up
    runs = [[once(*p) for p in points] for _ in range(repeats)]
    return {p: statistics.median(r[i] for r in runs) for i, p in enumerate(points)}


def fit_compute(cfg: Config, times: dict, peak: float) -> tuple[float, float, float]:
    """(rate FLOP/s, seconds per layer and pass unit, seconds per stage and pass unit) that
    fit ``times`` ({(blocks, microbatch): forward + backward s}) best in least squares as
    ``t = 3 FLOPs / rate + 3 blocks overhead + 3 per_pass``, none negative and the rate at
    most ``peak`` (a rate above it is noise: the fit then takes the peak)."""
    m, T, L = cfg.model, cfg.train.seq_len, cfg.model.n_layers
    whole = forward_flops_per_token(m, T)

    def flops(n, b):
        return b * T * (whole - sum(layer_flops(cfg, i) for i in range(n, L)))
    pts = sorted(times)
    cols = [[3 * flops(n, b) for n, b in pts], [3.0 * n for n, _ in pts], [3.0 for _ in pts]]
    y = [times[p] - 3 * flops(*p) / peak for p in pts]  # beyond the peak's FLOPs time
    usable = [0, 1, 2] if len({n for n, _ in pts}) > 1 else [0, 1]  # one depth: no per-stage
    x = _nonnegative_lstsq(cols, y, usable)
    return (peak if x[0] <= 0 else 1 / (1 / peak + x[0])), x[1], x[2]


def _nonnegative_lstsq(cols: list, y: list, usable: list) -> list[float]:
    """Least squares over the columns ``usable`` with every coefficient >= 0: the best of
    the unconstrained fits of each subset of columns whose coefficients are all >= 0."""
    import itertools

    import numpy as np

    A, b = np.array(cols, dtype=float).T, np.array(y, dtype=float)
    best, out = float(b @ b), [0.0] * len(cols)  # all zero
    for k in range(1, len(usable) + 1):
        for sub in map(list, itertools.combinations(usable, k)):
            coef = np.linalg.lstsq(A[:, sub], b, rcond=None)[0]
            r = A[:, sub] @ coef - b
            if (coef >= 0).all() and float(r @ r) < best:
                best, out = float(r @ r), [0.0] * len(cols)
                for i, c in zip(sub, coef):
                    out[i] = float(c)
    return out


def hook_cost(cfg: Config, alone, repeats: int = 5, microbatches: int = 4) -> float:
    """Seconds per parameter tensor and microbatch that the gradient hooks add: the whole
    model's backward over ``microbatches`` with ZeRO-2's hooks over the one-rank group
    ``alone`` (:func:`zero2_backwards`: nothing travels) against the same model without,
    interleaved, medians."""
    plain = whole_model(cfg)
    hooked, tensors = zero2_backwards(cfg, alone, alone, microbatches)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len))
    step_seconds(plain, x, microbatches), hooked()
    times = [(step_seconds(plain, x, microbatches), hooked()) for _ in range(repeats)]
    extra = statistics.median(b for _, b in times) - statistics.median(a for a, _ in times)
    return max(0.0, extra / (microbatches * tensors))


def trimmed_mean(xs: list[float], cut: float = 0.1) -> float:
    """The mean of ``xs`` without its ``cut`` smallest and ``cut`` largest fraction."""
    xs = sorted(xs)
    k = int(len(xs) * cut)
    return statistics.fmean(xs[k:len(xs) - k] or xs)


def ring_cost(cfg: Config, alone, repeats: int = 5) -> float:
    """Seconds per layer and pass unit (forward 1, backward 2) that context parallelism's
    ring attention (``parallel/ring_attention.py``) adds beyond the attention's FLOPs: one layer's
    attention of a microbatch over the one-rank ring ``alone`` (its block, the log-sum-exp
    merge, the gradient hop to itself) against PyTorch's fused causal attention of the same
    tensors, interleaved, medians, per 3 pass units. Mostly fixed per call (about the same a
    layer on 1 rank as in a cp=2 run's profile: docs/decisions.md), so the model charges it
    per layer."""
    from ..parallel.ring_attention import RingContext

    m, B, T = cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len
    T -= T % 2  # the ring's two chunks
    dtype = getattr(torch, m.dtype)
    q, k, v = (torch.randn(B, m.n_heads, T, m.head_dim, dtype=dtype, requires_grad=True)
               for _ in range(3))
    ring = RingContext(alone)
    fused = torch.nn.functional.scaled_dot_product_attention

    def run(attend):
        t0 = time.perf_counter()
        attend().sum().backward()
        return time.perf_counter() - t0
    ways = (lambda: ring.attention(q, k, v, 1), lambda: fused(q, k, v, is_causal=True))
    times = [[run(f) for f in ways] for _ in range(repeats + 1)][1:]
    extra = statistics.median(r for r, _ in times) - statistics.median(f for _, f in times)
    return max(0.0, extra / 3)


def split_cost(cfg: Config, repeats: int = 5) -> dict:
    """Zero-bubble's split backward on the whole model (``pipeline.runner.input_grad``): B
    (input gradients, the weight matmuls kept) and W (their weight gradients) each over one
    ordinary backward of the same forward, interleaved, medians: ``split_b``, ``split_w``."""
    from ..model import weight_grad
    from ..pipeline.runner import input_grad

    stage = whole_model(cfg)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.train.seq_len))

    def plain() -> tuple:
        stage.zero_grad(set_to_none=True)
        out = stage(x, x)
        t0 = time.perf_counter()
        out.backward()
        return (time.perf_counter() - t0,)

    def split() -> tuple:
        stage.zero_grad(set_to_none=True)
        with weight_grad.armed():
            out = stage(x, x)
            t0 = time.perf_counter()
            _, pending = input_grad(out, None, None)
            t1 = time.perf_counter()
            pending.apply()
        return time.perf_counter() - t1, t1 - t0
    rounds = [(plain(), split()) for _ in range(repeats + 1)][1:]
    back = statistics.median(p[0] for p, _ in rounds)
    w, b = (statistics.median(s[k] for _, s in rounds) for k in (0, 1))
    return {"split_b": min(4.0, b / back), "split_w": min(4.0, w / back)}
