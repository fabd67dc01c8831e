"""comm's GPU path without a GPU: host tensors presented as CUDA arrays (the stand-in
exposes ``__cuda_array_interface__`` over host memory, as mpi4py's own tests do). Both the
CUDA-aware zero-copy path and host staging must give the numpy reference results."""

import numpy as np
import pytest
import torch

from hpctrain import comm
from hpctrain.comm import gpu

pytestmark = pytest.mark.mpi


def data(rank, shape, dtype=torch.float64):
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.parametrize("aware", [True, False])
def test_collectives_through_the_gpu_path(aware):
    world = comm.world()
    n, r = world.size, world.rank
    with gpu.stand_in(aware=aware) as backend:
        t = data(r, (6,))
        world.allreduce_(t)
        ref = sum(data(k, (6,)) for k in range(n))
        np.testing.assert_allclose(t.numpy(), ref.numpy(), rtol=1e-12)

        h = data(r, (5,), torch.bfloat16)
        world.iallreduce_(h).wait()
        ref16 = sum(data(k, (5,), torch.bfloat16).float() for k in range(n))
        np.testing.assert_allclose(h.float().numpy(), ref16.numpy(), rtol=3e-2, atol=3e-2)

        out = torch.empty(2 * n, dtype=torch.float64)
        world.allgather(data(r, (2,)), out)
        assert torch.equal(out, torch.cat([data(k, (2,)) for k in range(n)]))

        got = torch.zeros(3, dtype=torch.float64)
        hr = world.irecv(got, source=(r - 1) % n, tag=3)
        hs = world.isend(data(r, (3,)), dest=(r + 1) % n, tag=3)
        comm.wait_all([hs, hr])
        assert torch.equal(got, data((r - 1) % n, (3,)))

        b = data(r, (4,))
        world.bcast_(b, root=0)
        assert torch.equal(b, data(0, (4,)))
    # Every buffer was synchronised before MPI saw it; staging happened only when not aware.
    assert backend.synced > 0
    assert (backend.staged > 0) == (not aware) or n == 1


def test_env_override(monkeypatch):
    monkeypatch.setenv("HPCTRAIN_GPU_AWARE_MPI", "1")
    assert gpu.query_cuda_aware() is True
    monkeypatch.setenv("HPCTRAIN_GPU_AWARE_MPI", "0")
    assert gpu.query_cuda_aware() is False
    monkeypatch.setenv("HPCTRAIN_GPU_AWARE_MPI", "yes")
    with pytest.raises(ValueError, match="0 or 1"):
        gpu.query_cuda_aware()


def test_detection_without_override_on_this_mpi(monkeypatch):
    monkeypatch.delenv("HPCTRAIN_GPU_AWARE_MPI", raising=False)
    assert gpu.query_cuda_aware() in (True, False)  # Open MPI's query or the default


def test_cpu_runs_never_import_cuda_code():
    import sys

    t = torch.ones(2)
    comm.world().allreduce_(t)
    assert "cupy" not in sys.modules


@pytest.mark.gpu
def test_real_gpu_allreduce():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run tests/gpu/check.sh on a GPU machine)")
    world = comm.world()
    gpu.select_device(0)
    t = torch.ones(8, device="cuda")
    world.allreduce_(t)
    assert t.sum().item() == 8 * world.size
