"""The model alone (no MPI): shapes, layout-independent init, stage split = whole model."""

import torch

from hpctrain.config import load
from hpctrain.model import DecoderStage, init_parameters
from hpctrain.pipeline.placement import partition


def cfg():
    return load("share/configs/tiny.toml").model


def test_loss_is_a_sum_and_learns_shape():
    m = cfg()
    stage = DecoderStage(m, range(m.n_layers), first=True, last=True)
    init_parameters([stage], seed=1)
    x = torch.randint(0, 256, (2, 16))
    loss = stage(x, x)
    assert loss.dim() == 0 and loss.item() > 0
    # Sum over 32 tokens of ~ln(256) at init.
    assert abs(loss.item() / 32 - torch.log(torch.tensor(256.0)).item()) < 0.5
    loss.backward()
    assert all(p.grad is not None for p in stage.parameters())


def test_split_stages_equal_whole_model():
    m = cfg()
    whole = DecoderStage(m, range(m.n_layers), first=True, last=True)
    init_parameters([whole], seed=7)
    ranges = partition(m.n_layers, 3)
    parts = [DecoderStage(m, r, first=(i == 0), last=(i == 2)) for i, r in enumerate(ranges)]
    init_parameters(parts, seed=7)
    names = {n for p in parts for n, _ in p.named_parameters()}
    assert names == {n for n, _ in whole.named_parameters()}
    x = torch.randint(0, 256, (2, 16))
    h = x
    for p in parts[:-1]:
        h = p(h)
    assert torch.equal(parts[-1](h, x), whole(x, x))


def test_partition_balanced_and_explicit():
    assert [len(r) for r in partition(10, 4)] == [3, 3, 2, 2]
    assert partition(6, 2, [2]) == [range(0, 2), range(2, 6)]


def test_recompute_same_gradients():
    m = cfg()
    a = DecoderStage(m, range(m.n_layers), True, True)
    from dataclasses import replace
    b = DecoderStage(replace(m, recompute=True), range(m.n_layers), True, True)
    init_parameters([a], 3)
    init_parameters([b], 3)
    x = torch.randint(0, 256, (2, 16))
    a(x, x).backward()
    b(x, x).backward()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p.grad, q.grad), n
