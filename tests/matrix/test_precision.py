"""Mixed precision in one launch.

bfloat16: 16-bit compute, float32 master weights and Adam state (ZeRO-1 shards here), float32
gradient reduction; over 50 steps its loss tracks the float32 run within 2% at every step.
The demo model (4x128, seq 128, 4 ranks) takes minutes per run on the shared 2-core test
machine, so this uses the tiny preset at 2 layers (same code paths, 50 steps).

float16: dynamic loss scaling. A deliberately huge initial scale overflows; those steps are
skipped (no update, scale halved) until the scale fits, then the model trains; and the MoE
auxiliary losses are scaled like the token loss (their gradients match float32).
"""

import math

import numpy as np
import pytest
from inprocess import train_layout

SMALL = ("model.n_layers=2", "train.micro_batch_size=4", "checkpoint.save_final=false",
         "train.log_every=10")


def test_bf16_tracks_float32_over_50_steps(tmp_path):
    steps = ("train.steps=50",)
    f32 = train_layout(tmp_path / "f32", 1, *SMALL, *steps, 'model.dtype="float32"')
    bf16 = train_layout(tmp_path / "bf16", 2, *SMALL, *steps, 'model.dtype="bfloat16"',
                     "topology.dp=2", "optim.zero=1")
    a, b = f32.losses, bf16.losses
    assert len(a) == len(b) == 50
    rel = np.abs(b - a) / a
    assert rel.max() <= 0.02, f"bf16 departs from float32 by {rel.max():.2%} (step " \
                               f"{int(rel.argmax()) + 1})"
    assert b[-5:].mean() < b[:5].mean() - 0.3  # and it learns
    # 16-bit parameters keep float32 masters: state is 3 float32 tensors per element / dp.
    n = bf16.metrics[-1]["mem_params"] // 2
    assert bf16.metrics[-1]["mem_optimizer"] == pytest.approx(3 * 4 * n / 2, rel=0.02)


def test_fp16_loss_scaling_skips_overflow_and_trains(tmp_path):
    run = train_layout(tmp_path / "f16", 2, *SMALL, "train.steps=12", 'model.dtype="float16"',
                    "topology.dp=2", "optim.loss_scale=16777216")
    m = run.metrics
    skipped = m[-1]["skipped_steps"]
    assert 1 <= skipped < 10, skipped
    before = (0, 16777216.0)
    for x in m:  # a step is skipped exactly when its gradient overflowed; the scale halves
        overflow = not math.isfinite(x["grad_norm"])
        assert x["skipped_steps"] == before[0] + overflow, x
        assert x["loss_scale"] == (before[1] / 2 if overflow else before[1]), x
        before = (x["skipped_steps"], x["loss_scale"])
    assert not math.isfinite(m[0]["grad_norm"])  # the huge initial scale overflows
    assert all(math.isfinite(x) for x in run.losses)
    assert run.losses[-3:].mean() < run.losses[:3].mean() - 0.05  # and it still trains


MOE = ("model.num_experts=4", "model.moe_every=1", "train.steps=1")


def test_fp16_moe_auxiliary_losses_keep_their_weight(tmp_path):
    """float16 multiplies the token loss by the loss scale before backward and divides every
    gradient by it after; the MoE aux/z-loss gradients must be scaled alike, or they end up
    ``loss_scale`` times too small. Heavy aux/z coefficients make them most of the step-1
    gradient: float16 must match float32 there (a float32 run without them shows they matter).
    The initial scale 1024 keeps step 1 finite."""
    heavy = ("model.aux_loss_coef=1.0", "model.z_loss_coef=1.0")
    f16 = train_layout(tmp_path / "f16", 1, *SMALL, *MOE, *heavy, 'model.dtype="float16"',
                    "optim.loss_scale=1024")
    f32 = train_layout(tmp_path / "f32", 1, *SMALL, *MOE, *heavy, 'model.dtype="float32"')
    light = train_layout(tmp_path / "light", 1, *SMALL, *MOE, 'model.dtype="float32"',
                      "model.aux_loss_coef=0.0", "model.z_loss_coef=0.0")
    assert f16.metrics[0]["loss_scale"] == 1024 and f16.metrics[0]["skipped_steps"] == 0
    n16, n32, n0 = f16.grad_norms[0], f32.grad_norms[0], light.grad_norms[0]
    assert abs(n32 - n0) > 0.2 * n32, (n32, n0)  # the aux/z terms dominate the gradient
    assert abs(n16 - n32) <= 0.01 * n32, f"float16 grad norm {n16} vs float32 {n32} " \
                                          f"(without aux/z losses: {n0})"
    assert f16.metrics[0]["moe_z_loss"] == pytest.approx(f32.metrics[0]["moe_z_loss"], 1e-2)
