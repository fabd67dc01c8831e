"""The zero-bubble split backward (``model/weight_grad.py``, ``pipeline.runner.input_grad``) on
one process, float64: B (everything but the weight matmuls) then W (the matmuls), for several
microbatches interleaved as a zero-bubble schedule runs them, gives the gradients of one plain
backward per microbatch (1e-12), accumulated in place into existing ``.grad`` tensors; B leaves
every matmul weight's ``.grad`` untouched; W fires each parameter's post-accumulate hook once."""

import pytest
import torch

from hpctrain.config import ModelConfig
from hpctrain.model import weight_grad
from hpctrain.model.moe import LocalExchange, MoE
from hpctrain.model.stage import DecoderStage, LocalOps, init_parameters
from hpctrain.pipeline.runner import input_grad

MATMULS = ("wq", "wk", "wv", "wo", "w1", "w2", "w3", "head")
ORDER = ["B0", "B1", "W0", "B2", "W2", "W1"]  # each B before its W, W out of order


def _stage(arch: str, where: str, moe: bool, recompute: bool = False):
    cfg = ModelConfig(arch=arch, n_layers=2, d_model=16, n_heads=4, n_kv_heads=2,
                      d_ff=32, vocab_size=32, dtype="float64", recompute=recompute,
                      num_experts=4 if moe else 0, top_k=2)
    ffn = None
    if moe:
        def ffn(_layer):
            return MoE(cfg, LocalOps(), LocalExchange(), torch.float64, 0.01)
    stage = DecoderStage(cfg, range(2), first=where == "first", last=where == "last",
                     ffn_factory=ffn)
    init_parameters([stage], 7)
    for m in stage.modules():
        if isinstance(m, MoE):
            m.loss_scale = 0.25
    return stage


def _inputs(where: str):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(3):
        x = (torch.randint(0, 32, (2, 8), generator=g) if where == "first"
             else torch.randn(2, 8, 16, dtype=torch.float64, generator=g))
        grad = None if where == "last" else torch.randn(2, 8, 16, dtype=torch.float64,
                                                         generator=g)
        out.append((x, torch.randint(0, 32, (2, 8), generator=g), grad))
    return out


def _run(stage, data, where: str, split: bool):
    """Gradients of every parameter (into pre-existing .grad) and of each input."""
    named = list(stage.named_parameters())
    for _, p in named:
        p.grad = torch.full_like(p, 0.5)
    views = {n: p.grad for n, p in named}
    fired = {n: 0 for n, _ in named}
    hooks = [p.register_post_accumulate_grad_hook(lambda _p, n=n: fired.__setitem__(
        n, fired[n] + 1)) for n, p in named]
    gx = {}
    with weight_grad.armed(split):
        xs, outs, pending = {}, {}, {}
        for k, (x, y, _) in enumerate(data):
            xs[k] = x if where == "first" else x.clone().requires_grad_(True)
            outs[k] = stage(xs[k], y if where == "last" else None)
        for act in ORDER if split else [f"B{k}" for k in range(len(data))]:
            k = int(act[1:])
            if act[0] == "W":
                pending.pop(k).apply()
                continue
            x = None if where == "first" else xs[k]
            if split:
                before = {n: p.grad.clone() for n, p in named if n.split(".")[-1] in MATMULS}
                gx[k], pending[k] = input_grad(outs[k], data[k][2], x)
                for n, p in named:
                    if n in before:
                        assert torch.equal(p.grad, before[n]), f"B touched {n}"
            else:
                torch.autograd.backward(outs[k], data[k][2])
                gx[k] = None if x is None else x.grad
    for h in hooks:
        h.remove()
    assert all(p.grad is views[n] for n, p in named)  # accumulated in place
    assert set(fired.values()) == {len(data)}, fired  # once per parameter and microbatch
    return {n: p.grad.clone() for n, p in named}, gx


@pytest.mark.parametrize("arch,where,moe", [
    ("gpt", "middle", False), ("gpt", "last", False), ("gpt", "first", False),
    ("llama", "middle", False), ("llama", "last", False), ("gpt", "middle", True),
    ("llama", "first", True)])
def test_split_backward_equals_one_backward(arch, where, moe):
    stage = _stage(arch, where, moe)
    data = _inputs(where)
    (ref, ref_gx), (got, got_gx) = (_run(stage, data, where, s) for s in (False, True))
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-12, atol=1e-15, msg=n)
    for k in ref_gx:
        if ref_gx[k] is not None:
            torch.testing.assert_close(got_gx[k], ref_gx[k], rtol=1e-12, atol=0)


def test_split_backward_under_recompute():
    """Activation checkpointing replays the armed forward inside B."""
    plain, ckpt = _stage("llama", "middle", False), _stage("llama", "middle", False, True)
    data = _inputs("middle")
    ref, _ = _run(plain, data, "middle", False)
    got, _ = _run(ckpt, data, "middle", True)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-12, atol=1e-15, msg=n)


def test_unarmed_linear_is_f_linear():
    """Every schedule without W runs plain ``F.linear`` (no autograd Function of ours)."""
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    assert type(weight_grad.linear(x, w).grad_fn).__name__ != "_LinearBackward"
    with weight_grad.armed():
        assert type(weight_grad.linear(x, w).grad_fn).__name__ == "_LinearBackward"


def test_armed_backward_outside_b_is_refused():
    x = torch.randn(2, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    with weight_grad.armed():
        y = weight_grad.linear(x, w).sum()
    with pytest.raises(RuntimeError, match="outside weight_grad.deferring"):
        y.backward()
