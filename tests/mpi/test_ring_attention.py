"""Ring attention (``parallel/ring_attention.py``) inside MPI ranks: all ranks form one cp ring,
each holding chunks r and 2cp-1-r of the sequence. The output and the gradients of queries,
keys and values (this rank's positions) must equal causal attention over the whole sequence
in float64, with grouped-query heads; and the llama attention layer with a ring context
(rotary at global positions) must equal the same layer on one rank. With document ids
(``data.document_mask``) the ring equals causal attention of each document alone, and the
layer (rotary at document positions) equals one rank's. Every test runs for Ulysses and
the hybrid too."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hpctrain import comm
from hpctrain.config import ModelConfig
from hpctrain.data.dataset import context_positions
from hpctrain.model.layers import Attention, Rotary
from hpctrain.model.stage import LocalOps, init_parameters
from hpctrain.parallel.hybrid import HybridContext
from hpctrain.parallel.ring_attention import RingContext, segments
from hpctrain.parallel.ulysses import UlyssesContext
from hpctrain.topology import context_groups

pytestmark = pytest.mark.mpi

TOL = dict(rtol=1e-11, atol=1e-13)


@pytest.fixture(scope="module", params=["ring", "ulysses", "hybrid"])
def ring(request):
    """Each test runs with the ring, with Ulysses (``parallel/ulysses.py``, the same
    token layout, an all-to-all of heads) and with the hybrid (``parallel/hybrid.py``:
    Ulysses groups of 2 ranks, the ring across them; at 2 ranks one pair, which runs
    Ulysses' attention): all must equal one rank."""
    cp = comm.Group(comm.world().mpi.Dup(), "cp")
    if request.param == "hybrid":
        u = 2 if cp.size % 2 == 0 else 1
        topo = SimpleNamespace(cp_comm=cp)
        return HybridContext(cp, *context_groups(topo, u))
    return (RingContext if request.param == "ring" else UlyssesContext)(cp)


def heads(ring, groups: int) -> int:
    """Query heads: 4, or more where Ulysses needs the kv heads (H / groups) to divide by
    its group's size (a layout it refuses otherwise)."""
    split = ring.ulysses.size if isinstance(ring, HybridContext) else ring.cp_size
    return 4 * max(1, groups * split // 4)


def mine(t, ring, T):
    return t.detach()[:, :, torch.from_numpy(context_positions(T, ring.cp_size, ring.cp_rank))]


@pytest.mark.parametrize("groups", [1, 2])
def test_ring_equals_causal_attention(ring, groups):
    g = torch.Generator().manual_seed(7)
    B, H, T, hd = 2, heads(ring, groups), 4 * ring.cp_size, 6
    q, dout = (torch.randn(B, H, T, hd, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, H // groups, T, hd, generator=g, dtype=torch.float64)
            for _ in range(2))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    rep = [t.repeat_interleave(groups, 1) for t in whole[1:]]
    y = F.scaled_dot_product_attention(whole[0], *rep, is_causal=True)
    (y * dout).sum().backward()
    local = [mine(t, ring, T).clone().requires_grad_() for t in (q, k, v)]
    y_local = ring.attention(*local, groups)
    (y_local * mine(dout, ring, T)).sum().backward()
    torch.testing.assert_close(y_local, mine(y, ring, T), **TOL)
    for a, b in zip(local, whole):
        torch.testing.assert_close(a.grad, mine(b.grad, ring, T), **TOL)


def test_segments_are_the_sampler_positions():
    for cp in (1, 2, 4):
        for r in range(cp):
            pos = [p for a, n in segments(16 // cp, cp, r) for p in range(a, a + n)]
            assert pos == list(context_positions(16, cp, r))
    # every position exactly once over the ring
    assert sorted(p for r in range(4) for p in context_positions(16, 4, r)) == list(range(16))


@pytest.mark.parametrize("documents", [False, True])
def test_llama_attention_layer_with_ring(ring, documents):
    """With ``documents``: document ids and positions (rotary restarted per document), the
    same on both layers."""
    cfg = replace(ModelConfig(dtype="float64"), arch="llama", d_model=32, n_heads=8,
                  n_kv_heads=4)
    T = 4 * ring.cp_size
    rotary = Rotary(cfg.head_dim, cfg.rope_theta)
    one = Attention(cfg, LocalOps(), torch.float64, 0.02, rotary)
    cp = Attention(cfg, LocalOps(), torch.float64, 0.02, rotary, ring)
    for layer in (one, cp):
        stage = torch.nn.Module()
        stage.attn = layer
        init_parameters([stage], seed=3)
    x = torch.randn(2, T, cfg.d_model, generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)
    pos = torch.from_numpy(context_positions(T, ring.cp_size, ring.cp_rank))
    doc = None
    if documents:  # row 0: two documents, the second starting inside a chunk; row 1: one
        cut = T // 2 + 1
        ids = torch.stack([(torch.arange(T) >= cut).long(), torch.zeros(T, dtype=torch.long)])
        positions = torch.stack([torch.cat([torch.arange(cut), torch.arange(T - cut)]),
                                 torch.arange(T)])
        doc = torch.stack([ids, positions], dim=1)  # (B, 2, T)
    y = one(x, doc=doc)
    torch.testing.assert_close(cp(x[:, pos], doc=doc), y[:, pos], **TOL)


def per_document(q, k, v, ids, groups):
    """Causal attention of each document of each row alone (B, H, T, hd)."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        for d in ids[b].unique():
            at = (ids[b] == d).nonzero().flatten()
            kk, vv = (t[b:b + 1, :, at].repeat_interleave(groups, 1) for t in (k, v))
            out[b:b + 1, :, at] = F.scaled_dot_product_attention(q[b:b + 1, :, at], kk, vv,
                                                                 is_causal=True)
    return out


@pytest.mark.parametrize("groups", [1, 2])
def test_ring_with_documents_equals_each_document_alone(ring, groups):
    """Document masks over the ring: each cp rank's queries see only keys of their own
    document, wherever on the ring those keys live (documents cut across chunks, one that
    starts inside a chunk, a row that is one document); gradients too."""
    g = torch.Generator().manual_seed(11)
    B, H, T, hd = 3, heads(ring, groups), 4 * ring.cp_size, 6
    q, dout = (torch.randn(B, H, T, hd, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, H // groups, T, hd, generator=g, dtype=torch.float64)
            for _ in range(2))
    ids = torch.zeros(B, T, dtype=torch.int64)
    ids[0, T // 3:] = 1
    ids[0, T - 1:] = 2  # a one-token document at the very end
    ids[1, 1:] = 1  # a one-token document first
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    y = per_document(*whole, ids, groups)
    (y * dout).sum().backward()
    local = [mine(t, ring, T).clone().requires_grad_() for t in (q, k, v)]
    y_local = ring.attention(*local, groups, ids)
    (y_local * mine(dout, ring, T)).sum().backward()
    torch.testing.assert_close(y_local, mine(y, ring, T), **TOL)
    for a, b in zip(local, whole):
        torch.testing.assert_close(a.grad, mine(b.grad, ring, T), **TOL)

