"""The MoE layer without MPI: routing, gating, capacity in global order, injected aux grads."""

import math

import pytest
import torch
import torch.nn.functional as F

from hpctrain.config import ModelConfig
from hpctrain.model.moe import LocalExchange, MoE, token_range
from hpctrain.model.stage import LocalOps, init_parameters


def make(k=1, capacity=0.0, E=4, aux=0.01, z=0.001, seed=0):
    cfg = ModelConfig(d_model=8, d_ff=16, n_layers=2, num_experts=E, top_k=k,
                      capacity_factor=capacity, aux_loss_coef=aux, z_loss_coef=z,
                      dtype="float64", init_std=0.5)
    layer = MoE(cfg, LocalOps(), LocalExchange(), torch.float64, 0.3)
    holder = torch.nn.Module()
    holder.mlp = layer
    init_parameters([holder], seed)
    layer.loss_scale = 0.5
    return layer


def naive(layer, x):
    """Per-token loop: sum over the top-k experts of gate * GELU-MLP."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        p = torch.softmax(layer.router @ x[t], -1)
        g, e = p.topk(layer.k)
        if layer.k > 1:
            g = g / g.sum()
        for gi, ei in zip(g, e):
            out[t] += gi * (layer.w2[ei] @ F.gelu(layer.w1[ei] @ x[t]))
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_dropless_matches_per_token_loop(k):
    layer = make(k)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    y = layer(x)
    torch.testing.assert_close(y.reshape(-1, 8), naive(layer, x.reshape(-1, 8)))
    assert int(layer.stats.load.sum()) == 10 * k and int(layer.stats.dropped.sum()) == 0


def test_layer_and_token_split_helpers():
    cfg = ModelConfig(num_experts=4, moe_every=2, n_layers=4)
    assert [i for i in range(4) if cfg.moe_layer(i)] == [1, 3]
    assert not ModelConfig().moe_layer(0)
    first_dense = ModelConfig(num_experts=4, dense_layers=2, n_layers=5)
    assert [i for i in range(5) if first_dense.moe_layer(i)] == [2, 3, 4]
    for n, parts in [(10, 3), (2, 4), (0, 2), (16, 2)]:
        ranges = [token_range(n, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_empty_input():
    layer = make(2, capacity=1.0)
    x = torch.zeros(0, 3, 8, dtype=torch.float64, requires_grad=True)
    y = layer(x)
    assert y.shape == (0, 3, 8)
    y.sum().backward()


class SplitExchange(LocalExchange):
    """Pretend to be rank ``position`` of R ranks whose counts are given."""

    def __init__(self, all_counts, position):
        self.all_counts, self.position = all_counts, position

    def gather_counts(self, counts):
        assert torch.equal(counts, self.all_counts[self.position])
        return self.all_counts


@pytest.mark.parametrize("k", [1, 2])
def test_capacity_keeps_the_same_assignments_on_any_split(k):
    layer = make(k, capacity=0.6, seed=3)
    xs = torch.randn(23, 8, dtype=torch.float64)
    _, _, expert, _ = layer.route(xs)
    whole = layer.keep_mask(expert, layer.exchange.gather_counts(torch.stack(
        [torch.bincount(expert[:, s], minlength=4) for s in range(k)])))
    cap = layer.capacity(23)
    assert cap == math.ceil(0.6 * 23 * k / 4)
    # A plain loop in priority order: first choices of all tokens, then second choices.
    used, expect = [0] * 4, torch.zeros_like(whole)
    for s in range(k):
        for t in range(23):
            e = int(expert[t, s])
            expect[t, s] = used[e] < cap
            used[e] += 1
    assert torch.equal(whole, expect) and not whole.all()
    cuts = [(0, 5), (5, 5), (5, 17), (17, 23)]  # includes a rank with no tokens
    counts = torch.stack([torch.stack([torch.bincount(expert[a:b, s], minlength=4)
                                       for s in range(k)]) for a, b in cuts])
    for r, (a, b) in enumerate(cuts):
        layer.exchange = SplitExchange(counts, r)
        assert torch.equal(layer.keep_mask(expert[a:b], counts), whole[a:b])


def test_aux_gradient_is_that_of_the_explicit_objective():
    layer = make(2, aux=0.3, z=0.2)
    x = torch.randn(12, 8, dtype=torch.float64)
    w = torch.randn(12, 8, dtype=torch.float64)
    (layer(x) * w).sum().mul(layer.loss_scale).backward()
    injected = layer.router.grad.clone()
    layer.router.grad = None
    # Explicit: scale * (out.w + N * (0.3 * aux + 0.2 * z)) with a non-injecting layer.
    layer.loss_scale = 0.0
    logits = x @ layer.router.T
    p = torch.softmax(logits, -1)
    top = p.topk(2).indices
    f = torch.stack([(top == e).sum() for e in range(4)]).double() / (12 * 2)
    aux = 4 * (f * p.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    obj = (layer(x) * w).sum() + 12 * (0.3 * aux + 0.2 * z)
    (obj * 0.5).backward()
    torch.testing.assert_close(injected, layer.router.grad)
    assert layer.stats.aux == pytest.approx(float(aux.detach()) * 2, rel=1e-12)  # two forwards
