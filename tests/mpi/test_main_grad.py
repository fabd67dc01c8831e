"""16-bit models accumulate and reduce gradients in float32 ("main grads"), at any world size
(run under mpirun; every rank is one dp rank).

Each microbatch's 16-bit gradient is exact (the loss is linear in the parameters with 16-bit
coefficients), so the float64 sum of all of them over microbatches and ranks is the exact
reduced gradient. Summing 16 microbatches in a bfloat16 buffer loses ~1e-3 relative; in
float32 ~1e-7. The gradient the optimizer used is read back from Adam's first moment after
one step (``exp_avg = (1 - beta1) * clipped gradient``), the norm from ``grad_norm()``.
"""

import pytest
import torch
from fakes import fake_topology

from hpctrain import comm
from hpctrain.config import OptimConfig
from hpctrain.model.stage import ParamMeta, _param
from hpctrain.optim import build_optimizer
from hpctrain.parallel import grad_sync

pytestmark = pytest.mark.mpi

MICROBATCHES = 16
SHAPES = {"vec": (37,), "mat": (5, 23)}  # bucket_mb below cuts them into two buckets


@pytest.fixture(scope="module")
def topo():
    world = comm.world()
    dp = comm.Group(world.mpi.Dup(), "dp")
    alone = comm.Group(world.mpi.Split(world.rank, 0), "tp")
    return fake_topology(group=dp, dp_comm=dp, tp_comm=alone)


def coefficients(rank: int, j: int, dtype) -> dict[str, torch.Tensor]:
    """Microbatch j's gradient on ``rank``: positive values over a few binades, exact in
    ``dtype`` (so rounding can only come from the accumulation)."""
    g = torch.Generator().manual_seed(7919 * rank + j)
    out = {}
    for name, shape in SHAPES.items():
        mant = 1 + torch.rand(shape, generator=g, dtype=torch.float64)
        exp = torch.randint(-3, 4, shape, generator=g).double()
        out[name] = (mant * 2.0**exp).to(dtype)
    return out


def exact(size: int, dtype) -> dict[str, torch.Tensor]:
    """The reduced gradient in float64: every rank's every microbatch."""
    return {name: sum(coefficients(r, j, dtype)[name].double()
                      for r in range(size) for j in range(MICROBATCHES))
            for name in SHAPES}


def one_step(topo, dtype, zero: int, overlap: bool, clip_to: float = 0.0,
             progress: str = "thread"):
    named = [(n, _param(s, ParamMeta(s), dtype)) for n, s in SHAPES.items()]
    for _, p in named:
        torch.nn.init.normal_(p.data)
    ocfg = OptimConfig(zero=zero, overlap=overlap, grad_clip=clip_to, weight_decay=0.0,
                       bucket_mb=200 / 2**20)
    grads = grad_sync.create(named, topo, ocfg.bucket_mb, zero=zero, overlap=overlap,
                        microbatches=MICROBATCHES, progress=progress)
    opt = build_optimizer(named, ocfg, topo, grads, str(dtype).removeprefix("torch."))
    grads.zero()
    for j in range(MICROBATCHES):
        c = coefficients(topo.dp_comm.rank, j, dtype)
        sum((p * c[n]).sum() for n, p in named).backward()
    grads.reduce()
    grads.close()
    norm = opt.grad_norm()
    opt.clip_and_step(1e-3, norm)
    used = {n: st["exp_avg"].double() / (1 - ocfg.beta1) for n, st in opt.state.items()}
    return named, grads, norm, used


# Overlapped reductions progress through the progress thread (default), MPI_Test from the
# hooks, or the final wait alone: the same sums every way.
@pytest.mark.parametrize("zero,overlap,progress", [
    (0, False, "thread"), (0, True, "thread"), (0, True, "test"), (0, True, "wait"),
    (1, False, "thread"), (1, True, "thread"), (1, True, "test"), (2, True, "thread"),
    (2, True, "wait"), (2, True, "test"), (0, True, "poll"), (2, True, "poll")])
def test_bf16_gradients_accumulate_and_reduce_in_float32(topo, zero, overlap, progress):
    ref = exact(topo.dp_comm.size, torch.bfloat16)
    ref_norm = sum(float(t.pow(2).sum()) for t in ref.values()) ** 0.5
    _, _, norm, used = one_step(topo, torch.bfloat16, zero, overlap, progress=progress)
    for name, want in ref.items():
        err = float(((used[name] - want).abs() / want.abs()).max())
        # bfloat16 accumulation: ~1e-3 (its unit roundoff is 3.9e-3); float32: ~1e-7
        assert err <= 2e-6, f"{name}: gradient off by {err:.2e} relative (16-bit rounding)"
    assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (norm, ref_norm)


@pytest.mark.parametrize("zero", [0, 1])
def test_clipping_acts_on_the_float32_gradient(topo, zero):
    ref = exact(topo.dp_comm.size, torch.bfloat16)
    ref_norm = sum(float(t.pow(2).sum()) for t in ref.values()) ** 0.5
    _, _, norm, used = one_step(topo, torch.bfloat16, zero, False, clip_to=ref_norm / 4)
    scale = (ref_norm / 4) / (norm + 1e-6)
    for name, want in ref.items():
        err = float(((used[name] - want * scale).abs() / (want * scale).abs()).max())
        assert err <= 2e-6, (name, err)


def test_the_bfloat16_sum_would_fail_this_test():
    """The tolerance separates the two: the same 16 microbatches summed in bfloat16."""
    ref = exact(1, torch.bfloat16)
    acc = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    for j in range(MICROBATCHES):
        for n, c in coefficients(0, j, torch.bfloat16).items():
            acc[n] += c
    err = max(float(((acc[n].double() - ref[n]).abs() / ref[n]).max()) for n in SHAPES)
    assert err > 100 * 2e-6, err


@pytest.mark.parametrize("zero", [0, 1])
def test_float32_main_grad_is_the_grad_itself(topo, zero):
    """32/64-bit models: no second buffer, ``.grad`` is a view into the flat buffer."""
    named, grads, _, used = one_step(topo, torch.float32, zero, False)
    flat = grads.flats[0]
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    for _, p in named:
        assert p.grad is not None and lo <= p.grad.data_ptr() < hi
        assert not hasattr(p, "main_grad")
    n = sum(p.numel() for _, p in named)
    pad = sum(b.numel for b in grads.buckets)
    assert grads.grad_bytes() == 4 * pad + (4 * pad // topo.dp_comm.size if zero else 0)
    assert pad - n < len(grads.buckets) * topo.dp_comm.size


def test_hooks_drive_progress_in_constant_time(topo, monkeypatch):
    """ZeRO-2 posts a reduction per bucket and microbatch; ``progress = test`` drives them
    from every gradient hook. A hook tests the oldest reduction not yet complete, never all
    posted so far (which cost O(microbatches^2) per step: 107k tests a step on the
    calibration model): over a step at most one test per hook plus one per reduction."""
    calls = []
    real = comm.Handle.test
    monkeypatch.setattr(comm.Handle, "test", lambda h: calls.append(1) or real(h))
    _, grads, _, _ = one_step(topo, torch.float32, 2, True, progress="test")
    hooks = MICROBATCHES * len(SHAPES)
    reductions = MICROBATCHES * len(grads.buckets)
    assert len(grads.buckets) == 2
    assert 0 < len(calls) <= hooks + reductions, (len(calls), hooks, reductions)
