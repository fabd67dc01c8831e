"""Multi-token prediction (hpctrain/model/mtp.py) against DeepSeek-V3's definition written
out here: module k sees the hidden states of depth k-1 at the first T-k positions and the
embeddings of the tokens k ahead, its block runs over that shorter sequence, and its
cross-entropy against the tokens k+1 ahead joins the objective with weight
mtp_loss_weight / D. The model instead runs every module over all T positions and drops the
targets past the window, which causality makes the same; the loss it reports stays the
main one. Also the sampler's look-ahead targets, with and without context parallelism."""

import numpy as np
import torch
import torch.nn.functional as F

from hpctrain.config import ModelConfig
from hpctrain.data.sampler import Sampler, context_positions
from hpctrain.model.stage import DecoderStage, init_parameters
from hpctrain.model.steps import drive

D, T, B, V = 2, 12, 3, 64


def model():
    m = ModelConfig(arch="llama", family="llama", n_layers=2, d_model=16, n_heads=4,
                    n_kv_heads=2, d_ff=32, vocab_size=V, dtype="float64", mtp_depth=D,
                    mtp_loss_weight=0.3)
    stage = DecoderStage(m, range(2), True, True)
    init_parameters([stage], seed=3)
    return m, stage


def grads(stage, loss_fn):
    stage.zero_grad()
    main = loss_fn()
    return float(main.detach()), {n: None if p.grad is None else p.grad.clone()
                                  for n, p in stage.named_parameters()}


def by_definition(m, stage, w):
    """The main loss, after backward of main + 0.3 / D * sum_k CE_k, each depth over the
    positions that have a target."""
    h = drive(stage.hidden_steps(w[:, :T]))
    main = F.cross_entropy(F.linear(stage.norm_f(h), stage.head).reshape(-1, V),
                           w[:, 1:T + 1].reshape(-1), reduction="sum")
    total = main
    for k, module in enumerate(stage.mtp, 1):
        n = T - k  # positions 0..T-k-1 have the token k+1 ahead
        e = stage.embed[w[:, k:k + n]]
        h = F.linear(torch.cat([module.enorm(e), module.hnorm(h[:, :n])], -1), module.eh_proj)
        h = stage.blocks[str(m.n_layers + k - 1)](h)
        total = total + 0.3 / D * F.cross_entropy(
            F.linear(module.norm(h), stage.head).reshape(-1, V),
            w[:, k + 1:k + 1 + n].reshape(-1), reduction="sum")
    total.backward()
    return main


def look_ahead(w, columns=None):
    """(x, y) as the sampler makes them for D ahead: y[:, j, i] = w[:, c_i + j + 1] or -1."""
    cols = np.arange(T) if columns is None else columns
    y = np.full((w.shape[0], D + 1, len(cols)), -1)
    for j in range(D + 1):
        ok = cols + j + 1 <= T
        y[:, j, ok] = w[:, cols[ok] + j + 1]
    return w[:, cols], y


def test_objective_is_deepseek_v3s_and_the_reported_loss_the_main_one():
    m, stage = model()
    w = torch.from_numpy(np.random.default_rng(0).integers(0, V, (B, T + 1)))
    x, y = (torch.from_numpy(a) for a in look_ahead(w.numpy()))
    mine, g_mine = grads(stage, lambda: _backward(stage(x, y)))
    ref, g_ref = grads(stage, lambda: by_definition(m, stage, w))
    assert mine == ref  # the main loss
    assert sorted(g_mine) == sorted(g_ref)
    for name in g_ref:
        assert torch.allclose(g_mine[name], g_ref[name], rtol=1e-12, atol=1e-14), name
    assert g_mine["mtp.1.eh_proj"].abs().max() > 0
    without = DecoderStage(m, range(2), True, True)  # the same weights, plain targets
    without.load_state_dict(stage.state_dict())
    _, g_main = grads(without, lambda: _backward(without(x, y[:, 0])))
    assert not torch.allclose(g_main["blocks.1.mlp.w1"], g_mine["blocks.1.mlp.w1"])
    assert g_main["mtp.0.eh_proj"] is None  # plain targets: the modules do not run


def _backward(loss):
    loss.backward()
    return loss


def test_sampler_looks_ahead_on_every_context_rank():
    tokens = np.arange(1000) % 997
    for cp in (1, 2):
        for r in range(cp):
            s = Sampler(tokens, T, 4, 2, 1, 0, seed=5, cp_size=cp, cp_rank=r, ahead=D)
            rows = s.host(0)[0]
            cols = None if cp == 1 else context_positions(T, cp, r)
            x, y = s.place([rows], 0)[0]
            want_x, want_y = look_ahead(rows, cols)
            assert np.array_equal(x.numpy(), want_x) and np.array_equal(y.numpy(), want_y)
            plain = Sampler(tokens, T, 4, 2, 1, 0, seed=5, cp_size=cp, cp_rank=r)
            assert np.array_equal(plain.place([rows], 0)[0][1].numpy(), want_y[:, 0])


def test_plan_counts_the_modules_flops_and_parameters():
    """FLOPs per token (the modules' blocks, projections and heads) against the FLOP
    counter, and the plan's parameter count against the model's."""
    from torch.utils.flop_counter import FlopCounterMode

    from hpctrain.config import load
    from hpctrain.planner.flops import train_flops_per_token
    from hpctrain.planner.memory import estimate

    m, stage = model()
    w = torch.from_numpy(np.random.default_rng(1).integers(0, V, (B, T + 1)))
    x, y = (torch.from_numpy(a) for a in look_ahead(w.numpy()))
    with FlopCounterMode(display=False) as fc:
        stage(x, y).backward()
    hd = m.d_model // m.n_heads  # SDPA on CPU is invisible to the counter: its core by shape
    core = (m.n_layers + D) * 3 * 2 * 2 * B * m.n_heads * T * T * hd
    assert fc.get_total_flops() + core == train_flops_per_token(m, T, causal=False) * B * T
    cfg = load("share/configs/tiny-llama.toml", ["model.mtp_depth=2"])
    counted = DecoderStage(cfg.model, range(cfg.model.n_layers), True, True)
    assert estimate(cfg).params == sum(p.numel() for p in counted.parameters()) * 8


def test_layouts_the_modules_cannot_run_are_refused():
    from hpctrain.checks.rules import problems
    from hpctrain.config import load

    def why(*sets):
        return " ".join(problems(load("share/configs/tiny-llama.toml",
                                      ["model.mtp_depth=1", *sets]), 4))

    assert "needs topology.pp=1" in why("topology.pp=2", "topology.dp=2")
    assert "optim.zero <= 2" in why("topology.dp=4", "optim.zero=3")
    assert why("topology.dp=2", "topology.tp=2", "optim.zero=2") == ""
