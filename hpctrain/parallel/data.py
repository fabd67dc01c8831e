"""Data parallelism: gradients live in flat buffers and are summed over the data-parallel
group in buckets, never one call per parameter.

Each parameter's ``.grad`` is a view into one flat buffer per reduction group (dense
parameters: ``topo.dp_comm``; expert parameters: ``topo.edp_comm``), so autograd accumulates
microbatch gradients in place and a bucket is handed to MPI without a copy. Buckets are cut in
reverse parameter order (the order backward produces gradients) at ``bucket_mb``.

The loss is scaled by 1/(global tokens) before backward, so the *sum* over ranks is exactly the
gradient of the global mean loss (no division after the reduction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import comm


@dataclass
class Bucket:
    group: comm.Group
    flat: torch.Tensor  # a contiguous slice of a flat gradient buffer
    names: list[str]


class GradBuffers:
    """Flat gradient storage and the bucketed reduction over the data-parallel groups."""

    def __init__(self, named_params, topo, bucket_mb: float, hierarchical=None):
        self.topo = topo
        self.named = list(named_params)
        self.hierarchical = hierarchical  # optional callable(flat) for multi-node dp
        by_group: dict[str, list] = {"dp": [], "edp": []}
        for name, p in self.named:
            by_group["edp" if p.hp.expert_dim is not None else "dp"].append((name, p))
        groups = {"dp": topo.dp_comm, "edp": topo.edp_comm}
        self.flats: list[torch.Tensor] = []
        self.buckets: list[Bucket] = []
        limit = max(1, int(bucket_mb * 2**20))
        for key, items in by_group.items():
            if not items:
                continue
            self._build(items, groups[key], limit)
        self.sp_params = [p for _, p in self.named if p.hp.sp_partial and topo.tp_size > 1]

    def _build(self, items, group: comm.Group, limit: int) -> None:
        dtype = items[0][1].dtype
        if any(p.dtype != dtype for _, p in items):
            raise ValueError("all parameters of one reduction group must share a dtype")
        total = sum(p.numel() for _, p in items)
        flat = torch.zeros(total, dtype=dtype, device=items[0][1].device)
        self.flats.append(flat)
        # Reverse order: the last layers' gradients are final first during backward.
        offset, bucket_start, names, nbytes = total, total, [], 0
        for name, p in reversed(items):
            n = p.numel()
            offset -= n
            p.grad = flat[offset:offset + n].view_as(p)
            names.append(name)
            nbytes += n * flat.element_size()
            if nbytes >= limit:
                self.buckets.append(Bucket(group, flat[offset:bucket_start], names))
                bucket_start, names, nbytes = offset, [], 0
        if names:
            self.buckets.append(Bucket(group, flat[offset:bucket_start], names))

    def zero(self) -> None:
        for flat in self.flats:
            flat.zero_()

    def reduce(self) -> None:
        """Sum gradients over tp where sequence parallelism left them partial, then over
        each bucket's data-parallel group (nonblocking, all posted before the first wait).
        Collective over tp_comm, dp_comm and edp_comm."""
        for p in self.sp_params:
            self.topo.tp_comm.allreduce_(p.grad)
        if self.hierarchical is not None:
            for b in self.buckets:
                self.hierarchical(b)
            return
        handles = [b.group.iallreduce_(b.flat) for b in self.buckets if b.group.size > 1]
        comm.wait_all(handles)

    def reduce_per_parameter(self) -> None:
        """The naive baseline: one blocking all-reduce per parameter (benchmarks only)."""
        for p in self.sp_params:
            self.topo.tp_comm.allreduce_(p.grad)
        for name, p in self.named:
            group = self.topo.edp_comm if p.hp.expert_dim is not None else self.topo.dp_comm
            group.allreduce_(p.grad)
