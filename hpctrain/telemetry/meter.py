"""Measured memory of one rank (:class:`Meter`): bytes of the parameters + gradient storage
(flat buffers, shards, staging) + optimizer state + the maximum over the step of the bytes held
by autograd's saved tensors (``torch.autograd.graph.saved_tensors_hooks``, counted once per
storage, parameters excluded). Temporaries that autograd does not save (an op's output
before the next op consumes it, gradient tensors during backward) and the recomputation
transient are not counted: on CPU there is no allocator statistic to read them from. The
plan's estimate is :mod:`hpctrain.planner.memory`.
"""

from __future__ import annotations

import contextlib

import torch


class _Saved:
    """A saved tensor wrapped so that its release is seen."""

    __slots__ = ("t", "meter", "key")

    def __init__(self, t, meter, key):
        self.t, self.meter, self.key = t, meter, key

    def __del__(self):
        self.meter._release(self.key)


def _nbytes(params) -> int:
    return sum(p.numel() * p.element_size() for _, p in params)


class ActivationMeter:
    """Bytes held by autograd's saved tensors: live now and the peak, each storage counted
    once, the given parameters' storages excluded. Not collective; no MPI."""

    def __init__(self, exclude=()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.gathered: set = set()  # zero 3: storages of gathered parameters, now
        self._live: dict[int, list] = {}  # storage ptr -> [refs, bytes]
        self.current = self.peak = 0

    def _pack(self, t: torch.Tensor):
        key = t.untyped_storage().data_ptr()
        if key in self._exclude or key == 0 or key in self.gathered:
            return t
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [0, t.untyped_storage().nbytes()]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Saved(t, self, key)

    @staticmethod
    def _unpack(h):
        return h.t if isinstance(h, _Saved) else h

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._live[key]

    @contextlib.contextmanager
    def activations(self):
        """Count saved tensors made inside the block (wrap forward and backward)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def take_peak(self) -> int:
        """The peak since the last call; resets it to the live bytes."""
        out, self.peak = self.peak, self.current
        return out


class Meter(ActivationMeter):
    """Measured memory of one rank (see the module docstring). Not collective.

    The saved-tensor hooks run at the first step metered and every ``every``-th step
    (``telemetry.activations_every``): ``mem_activations`` is the latest such step's peak,
    ``mem_activations_step`` that step."""

    def __init__(self, named_params, grads, optimizer, every: int = 1):
        self.params, self.grads, self.optimizer = list(named_params), grads, optimizer
        super().__init__([p for _, p in self.params])
        if getattr(grads, "sharded", None) is not None:
            self.gathered = grads.sharded.storages  # updated by every gather and free
        self.every = every
        self.metered: int | None = None  # the step (1-based) counted now, if any
        self.last: tuple[int, int] = (0, 0)  # (step, activation peak) of the latest count

    def step(self, step: int):
        """Wrap step ``step``'s (1-based) forward and backward: counted when it is the first
        step here or a multiple of ``every``, else nothing runs."""
        first = self.last[0] == 0
        self.metered = step if first or step % self.every == 0 else None
        return self.activations() if self.metered else contextlib.nullcontext()

    def take(self) -> dict:
        """This step's measured bytes (metrics keys ``mem_*``); resets the activation peak."""
        sharded = getattr(self.grads, "sharded", None)  # zero 3: shards + gathered peak
        gathered = sharded.take_peak() if sharded else 0
        out = {"mem_params": sharded.shard_bytes() + gathered if sharded
               else _nbytes(self.params),
               "mem_grads": self.grads.grad_bytes(),
               "mem_optimizer": self.optimizer.state_bytes(),
               "mem_activations": self._activations()}
        out["mem_peak"] = sum(out.values())
        out["mem_activations_step"] = self.last[0]
        # Evidence of overlap: bucket reductions posted while backward was still running.
        out["grad_buckets_posted_in_backward"] = getattr(self.grads, "posted_early", 0)
        if sharded:  # the part of mem_params that is all-gathered blocks, at its peak
            out["mem_params_gathered"] = gathered
        return out

    def _activations(self) -> int:
        if self.metered:
            self.last, self.metered = (self.metered, self.take_peak()), None
        return self.last[1]
