"""Each tensor-parallel piece against the unsharded layer, inside MPI ranks (any world size;
all ranks form one tp group). Forward outputs, input gradients and weight gradients (this
rank's slice of the global gradient) must match in float64, with and without sequence
parallelism; the vocab-parallel embedding/cross-entropy also with padded vocabularies."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from hpctrain import comm
from hpctrain.config import ModelConfig
from hpctrain.model.layers import MLP, Attention, Rotary
from hpctrain.model.stage import DecoderStage, LocalOps, init_parameters, local_slice
from hpctrain.optim.adamw import global_grad_norm
from hpctrain.parallel import grad_sync
from hpctrain.parallel.tensor import TensorParallelOps

pytestmark = pytest.mark.mpi

B, T = 2, 8
CFG = ModelConfig(n_layers=2, d_model=16, n_heads=4, d_ff=32, vocab_size=11, dtype="float64")
# The llama form: rotary, SwiGLU, 8 query heads on 4 kv heads (tp 1, 2, 4 split both).
LLAMA = replace(CFG, arch="llama", d_model=32, n_heads=8, n_kv_heads=4)
# Per-head q/k norms (replicated, their gradient summed over tp), q/k/v biases split with their
# projections, heads of 6 channels on d_model 32 (Qwen's attention options).
QWEN = replace(LLAMA, qk_norm=True, qkv_bias=True, d_head=6)
ARCH = {"gpt": CFG, "llama": LLAMA, "qwen": QWEN}
TOL = dict(rtol=1e-11, atol=1e-13)


@pytest.fixture(scope="module")
def tp():
    world = comm.world()
    return comm.Group(world.mpi.Dup(), "tp")


def fits(tp, sp: bool, cfg=CFG) -> None:
    if cfg.kv_heads % tp.size or cfg.ffn_dim % tp.size or (sp and T % tp.size):
        pytest.skip(f"the test model does not split over {tp.size} ranks")


def randn(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def seq_slice(tp, sp: bool) -> slice:
    n = T // tp.size
    return slice(tp.rank * n, (tp.rank + 1) * n) if sp else slice(0, T)


def assert_grads_match(par, full, tp) -> None:
    """Every parameter's local gradient equals its slice of the global gradient."""
    ref = dict(full.named_parameters())
    for name, p in par.named_parameters():
        index, extent = local_slice(p.hp, tp.size, tp.rank)
        local = p.grad[tuple(slice(0, n) for n in extent)]
        torch.testing.assert_close(local, ref[name].grad[index], **TOL, msg=name)
        pad = p.grad.clone()
        pad[tuple(slice(0, n) for n in extent)] = 0
        assert not pad.any(), f"{name}: gradient in padding rows"


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_conjugate_ops(tp, sp):
    """enter_tp/exit_tp forward and backward against the definitions in the docstring."""
    fits(tp, sp)
    ops, s = TensorParallelOps(tp, sp), seq_slice(tp, sp)
    full = randn(B, T, 3, seed=1)  # the same on every rank
    per_rank = [randn(B, T, 3, seed=10 + r) for r in range(tp.size)]
    total = sum(per_rank)
    # enter: replicated (or sequence slice) -> full sequence; gradient summed over ranks.
    x = full[:, s].clone().requires_grad_()
    y = ops.enter_tp(x)
    torch.testing.assert_close(y, full, **TOL)
    y.backward(per_rank[tp.rank])
    torch.testing.assert_close(x.grad, total[:, s], **TOL)
    # exit: per-rank partial sums -> their sum (or this rank's slice of it).
    x = per_rank[tp.rank].clone().requires_grad_()
    y = ops.exit_tp(x)
    torch.testing.assert_close(y, total[:, s], **TOL)
    g = randn(B, T, 3, seed=2)
    y.backward(g[:, s])
    torch.testing.assert_close(x.grad, g, **TOL)


def make(layer, cfg, ops):
    if layer is Attention:
        return Attention(cfg, ops, torch.float64, 0.01, Rotary(cfg.head_dim, cfg.rope_theta))
    return layer(cfg, ops, torch.float64, 0.01)


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("layer", [Attention, MLP], ids=["attention", "mlp"])
def test_parallel_layer(tp, layer, sp, arch):
    """Column-parallel in, row-parallel out: enter_tp -> layer -> exit_tp == the full layer.
    llama: query and kv heads split together (grouped-query), rotary on the full sequence,
    SwiGLU's gate and up column-parallel."""
    cfg = ARCH[arch]
    fits(tp, sp, cfg)
    ops, s = TensorParallelOps(tp, sp), seq_slice(tp, sp)
    full = make(layer, cfg, LocalOps())
    par = make(layer, cfg, ops)
    init_parameters([full], seed=7)
    init_parameters([par], seed=7, tp_size=tp.size, tp_rank=tp.rank)
    x, g = randn(B, T, cfg.d_model, seed=3), randn(B, T, cfg.d_model, seed=4)
    x_full = x.clone().requires_grad_()
    ref = full(x_full)
    ref.backward(g)
    x_par = x[:, s].clone().requires_grad_()
    out = ops.exit_tp(par(ops.enter_tp(x_par)))
    torch.testing.assert_close(out, ref[:, s].detach(), **TOL)
    out.backward(g[:, s])
    torch.testing.assert_close(x_par.grad, x_full.grad[:, s], **TOL)
    assert_grads_match(par, full, tp)


@pytest.mark.parametrize("vocab", [16, 11, 5])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_vocab_parallel_embedding_head_and_norm(tp, vocab, tie, sp):
    """Embedding -> final norm -> head -> vocab-parallel cross-entropy (vocab 11 and 5 pad
    the last rank; 5 over 4 ranks leaves one rank with padding only). The norm weight's
    SP-partial gradient is summed by the grad sync; the global grad norm counts each
    parameter once."""
    fits(tp, sp)
    cfg = ModelConfig(**{**CFG.__dict__, "vocab_size": vocab, "tie_embeddings": tie})
    full = DecoderStage(cfg, [], first=True, last=True)
    par = DecoderStage(cfg, [], first=True, last=True, ops=TensorParallelOps(tp, sp))
    init_parameters([full], seed=5)
    init_parameters([par], seed=5, tp_size=tp.size, tp_rank=tp.rank)
    g = torch.Generator().manual_seed(6)
    idx = torch.randint(0, vocab, (B, T), generator=g)
    targets = torch.randint(0, vocab, (B, T), generator=g)
    targets[0, 0], targets[0, 1] = 0, vocab - 1  # both ends of the vocabulary
    ref = full(idx, targets)
    ref.backward()
    named = list(par.named_parameters())
    grads = grad_sync.create(named, fake_topo(tp), bucket_mb=1.0)  # .grad views, zeroed
    loss = par(idx, targets)
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    loss.backward()
    grads.reduce()  # sums SP-partial norm gradients over tp
    assert_grads_match(par, full, tp)
    ref_norm = sum(p.grad.pow(2).sum() for p in full.parameters()).sqrt().item()
    norm = global_grad_norm(named, fake_topo(tp))
    assert abs(norm - ref_norm) <= 1e-12 * ref_norm


def fake_topo(tp):
    """The tp group as the whole world, with no data parallelism (dp groups of one)."""
    alone = comm.Group(comm.world().mpi.Split(tp.mpi.Get_rank(), 0), "dp")
    return SimpleNamespace(tp_comm=tp, tp_size=tp.size, tp_rank=tp.rank, dpcp_comm=alone,
                           edpcp_comm=alone, dp_rank=0, world=tp)


@pytest.mark.parametrize("arch", ["gpt", "llama", "qwen"])
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recompute"])
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_whole_stage(tp, sp, recompute, arch):
    """Embedding, two blocks, head and loss together; with activation recomputation the
    backward re-runs the forward collectives, in the same order on every tp rank."""
    fits(tp, sp, ARCH[arch])
    cfg = replace(ARCH[arch], recompute=recompute)
    full = DecoderStage(cfg, [0, 1], first=True, last=True)
    par = DecoderStage(cfg, [0, 1], first=True, last=True, ops=TensorParallelOps(tp, sp))
    init_parameters([full], seed=8)
    init_parameters([par], seed=8, tp_size=tp.size, tp_rank=tp.rank)
    g = torch.Generator().manual_seed(9)
    idx, targets = torch.randint(0, cfg.vocab_size, (2, B, T), generator=g)
    ref = full(idx, targets)
    ref.backward()
    grads = grad_sync.create(list(par.named_parameters()), fake_topo(tp), bucket_mb=1.0)
    loss = par(idx, targets)
    torch.testing.assert_close(loss, ref.detach(), **TOL)
    loss.backward()
    grads.reduce()
    assert_grads_match(par, full, tp)
