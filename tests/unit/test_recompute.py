"""Activation recomputation (``model.recompute``, full and selective): the same gradients,
less saved memory.

Memory is measured as the bytes autograd holds in saved tensors (``saved_tensors_hooks``,
each storage once, parameters excluded; :class:`hpctrain.telemetry.meter.ActivationMeter`): on CPU
there is no allocator statistic. With recompute, a block keeps only its input; the block's
own activations live again, one block at a time, during its backward (inside checkpoint's
hooks, so the meter does not see them: the plan adds them).
"""

import dataclasses

import pytest
import torch

from hpctrain.config import load
from hpctrain.model.stage import DecoderStage, init_parameters
from hpctrain.planner import memory
from hpctrain.telemetry.meter import ActivationMeter, Meter

TINY = "share/configs/tiny.toml"
TINY_LLAMA = "share/configs/tiny-llama.toml"


def _grads_and_peak(cfg):
    stage = DecoderStage(cfg.model, range(cfg.model.n_layers), first=True, last=True)
    init_parameters([stage], cfg.train.seed)
    g = torch.Generator().manual_seed(0)
    B, T = cfg.train.micro_batch_size, cfg.train.seq_len
    x = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)
    y = torch.randint(0, cfg.model.vocab_size, (B, T), generator=g)
    meter = ActivationMeter(list(stage.parameters()))
    with meter.activations():
        stage(x, y).backward()
    assert meter.current == 0  # everything saved was released by backward
    return {n: p.grad.clone() for n, p in stage.named_parameters()}, meter.peak


@pytest.mark.parametrize("preset", [TINY, TINY_LLAMA])
def test_recompute_same_gradients_less_memory(preset):
    cfg = load(preset, ["train.micro_batch_size=2"])
    on = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute=True))
    g0, peak0 = _grads_and_peak(cfg)
    g1, peak1 = _grads_and_peak(on)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name  # bitwise: the same ops again
    assert peak1 < 0.25 * peak0, (peak1, peak0)
    # The plan (within 2%): as measured without recompute; with it, measured + one block's
    # activations (2 sequences) live again during that block's backward.
    assert abs(memory.estimate(cfg).activations - peak0) <= 0.02 * peak0
    transient = memory.block_activation_bytes(on) * 2
    assert abs(memory.estimate(on).activations - (peak1 + transient)) <= 0.02 * peak1


@pytest.mark.parametrize("preset", [TINY, TINY_LLAMA])
def test_selective_recompute_same_gradients_plan_as_measured(preset):
    """``model.recompute = "selective"``: only the attention core is replayed; the gradients
    are bitwise those of no recompute, the saved bytes drop by the core's own (its
    log-sum-exp; llama: the rotated and repeated keys) and the plan says so exactly."""
    cfg = load(preset, ["train.micro_batch_size=2"])
    sel = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, recompute="selective"))
    g0, peak0 = _grads_and_peak(cfg)
    g1, peak1 = _grads_and_peak(sel)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name
    assert peak1 < peak0
    assert abs(memory.estimate(sel).activations - peak1) <= 0.02 * peak1
    saved = memory.block_activation_bytes(cfg) - memory.block_activation_bytes(sel)
    assert abs((peak0 - peak1) - 2 * cfg.model.n_layers * saved) <= 0.02 * (peak0 - peak1)


def test_meter_counts_each_storage_once():
    w = torch.randn(4, 4, requires_grad=True)
    meter = ActivationMeter([w])
    x = torch.randn(8, 4)
    with meter.activations():
        h = x @ w  # saves x (w excluded)
        out = (h * h).sum() + (h.sin()).sum()  # h saved by two ops: counted once
    assert meter.peak == x.nbytes + h.nbytes
    out.backward()
    assert meter.current == 0


def test_meter_counts_the_first_step_and_every_nth():
    """``telemetry.activations_every``: the hooks run at the first step and every N-th;
    between them the latest count (and its step) is reported, never 0."""
    w = torch.randn(4, 4, requires_grad=True)
    grads = type("G", (), {"grad_bytes": lambda self: 0, "sharded": None})()
    optim = type("O", (), {"state_bytes": lambda self: 0})()
    meter = Meter([("w", w)], grads, optim, every=3)
    seen = []
    for step in range(2, 9):  # a resumed run: its first step is 2
        x = torch.randn(8 * step, 4)  # a different activation size each step
        with meter.step(step):
            (x @ w).sum().backward()
        got = meter.take()
        seen.append((step, got["mem_activations_step"], got["mem_activations"]))
    counted = {s: 8 * s * 4 * 4 for s in (2, 3, 6)}  # x's bytes at the counted steps
    assert [(s, k) for s, k, _ in seen] == [(2, 2), (3, 3), (4, 3), (5, 3), (6, 6), (7, 6),
                                            (8, 6)]
    assert all(a == counted[k] for _, k, a in seen)
