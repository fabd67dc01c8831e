"""ZeRO's gradient norm stays on the parameters' device (no MPI, no GPU needed).

The parameters, gradient buffers and shards are built on PyTorch's ``meta`` device, and the
norm runs under a dispatch mode that records the device of every tensor any operation takes
or makes: the code path a CUDA run takes, with ``meta`` standing in for the GPU. A reduction
started on the host (``torch.zeros(())`` without a device) shows up as a ``cpu`` tensor.
"""

import pytest
import torch
from fakes import fake_topology
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hpctrain.config import OptimConfig
from hpctrain.model.stage import ParamMeta
from hpctrain.optim.adamw import LossScaler
from hpctrain.optim.zero import ZeroAdamW
from hpctrain.parallel import grad_sync


class DeviceRecorder(TorchDispatchMode):
    """Records (op, device) for every tensor an op receives or returns. ``.item()`` on a
    meta tensor (the one host transfer, for the world all-reduce) answers 1.0."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.device.type))
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return 1.0
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.seen.append((str(func), t.device.type))
        return out


def _meta_zero(tp_rank: int, scaler: bool) -> ZeroAdamW:
    topo = fake_topology(tp=2, tp_rank=tp_rank, dp=2, dp_rank=1)
    named = []
    for i, (shape, tp_dim) in enumerate([((6, 4), 0), ((5,), None), ((3, 4), 1)]):
        p = torch.nn.Parameter(torch.empty(shape, device="meta"))
        p.hp = ParamMeta(shape, tp_dim=tp_dim)
        named.append((f"p{i}", p))
    grads = grad_sync.create(named, topo, bucket_mb=40 / 2**20, zero=1)
    ocfg = OptimConfig(zero=1)
    return ZeroAdamW(grads, ocfg, topo, LossScaler(enabled=scaler, init_scale=8.0))


@pytest.mark.parametrize("tp_rank", [0, 1])
@pytest.mark.parametrize("scaler", [False, True])
def test_zero_grad_norm_stays_on_the_parameters_device(tp_rank, scaler):
    opt = _meta_zero(tp_rank, scaler)
    assert len(opt.grads.buckets) >= 2 and all(b.shard.is_meta for b in opt.grads.buckets)
    rec = DeviceRecorder()
    with rec:
        norm = opt.grad_norm()
    assert rec.seen, "the dispatch mode saw no operation"
    off = sorted({(op, dev) for op, dev in rec.seen if dev != "meta"})
    assert not off, f"tensors off the parameters' device: {off}"
    assert norm == 1.0  # the stand-in all-reduce of the meta sum's .item()
