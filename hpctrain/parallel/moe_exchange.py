"""Expert parallelism: the communicating ``exchange`` of :class:`hpctrain.model.moe.MoE`.

Experts are split over ``topo.ep_comm`` (rank ``r`` holds experts ``[r*E/ep, (r+1)*E/ep)``);
expert gradients are summed over ``topo.edp_comm`` and dense ones over ``topo.dp_comm`` by
the gradient sync, ``parallel/grad_sync/interface.py`` (``ParamMeta.expert_dim``).

One MoE layer's forward on a rank, all collectives in this order on every rank:

1. ``gather_counts``: all-gather of the (k, E) routing counts over tp_comm, then dp_comm
   (the global microbatch's statistics and each rank's place in the global token order);
2. dispatch: ``alltoall_counts`` of rows per (peer, local expert), then ``Alltoallv`` of the
   token vectors over ep_comm;
3. combine: the inverse ``Alltoallv``.

Backward: the gradient of dispatch is the combine-shaped exchange and vice versa
(:class:`_AllToAll`). With pp, ranks of one ep_comm share a pipeline stage and run the same
schedule, so they post these collectives in the same order.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..model.layers import ParamMeta
from ..model.moe import MoE, exchange_of, moe_layers
from ..model.stage import DTYPES


class _AllToAll(torch.autograd.Function):
    """Rows grouped by destination -> rows grouped by source over the exchange's ep_comm; the
    backward is the inverse exchange. Collective over ep_comm in forward and backward."""

    @staticmethod
    def forward(ctx, x, exchange, send_rows, recv_rows):
        ctx.exchange, ctx.send_rows, ctx.recv_rows = exchange, send_rows, recv_rows
        return exchange.blocking(x, send_rows, recv_rows)

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange.blocking(grad, ctx.recv_rows, ctx.send_rows), None, None, None


class _Received(torch.autograd.Function):
    """Joins rows that a nonblocking exchange delivered (``buf``, already complete) to the
    graph of the rows sent (``x``); the backward is the blocking inverse exchange.
    Collective over ep_comm in backward."""

    @staticmethod
    def forward(ctx, x, buf, exchange, send_rows, recv_rows):
        ctx.exchange, ctx.send_rows, ctx.recv_rows = exchange, send_rows, recv_rows
        return buf

    @staticmethod
    def backward(ctx, grad):
        back = ctx.exchange.blocking(grad, ctx.recv_rows, ctx.send_rows)
        return back, None, None, None, None


class ExpertExchange:
    """The MPI version of ``model.moe.LocalExchange`` (same contract), one per run: it also
    keeps this run's all-to-all accounting and the exchanges in flight.

    Collective groups: ``gather_counts`` over tp_comm, cp_comm, then dp_comm; the others
    over ep_comm.
    ``a2a``: this step's all-to-all seconds on this rank, ``busy`` = posted until complete
    (blocking calls: their duration), ``exposed`` = spent waiting; busy - exposed was hidden.
    """

    def __init__(self, topo):
        self.topo = topo
        self.group = topo.ep_comm
        self.ep_size, self.ep_rank = topo.ep_size, topo.ep_rank
        # Global token order: dp rank (data.Sampler's order), then the tp slice (with cp > 1
        # the cp rank in between; capacity, which needs the order, is refused there).
        self.position = (topo.dp_rank * topo.cp_size + topo.cp_rank) * topo.tp_size \
            + topo.tp_rank
        self.a2a = {"busy": 0.0, "exposed": 0.0, "calls": 0}
        self.pending: list = []  # [Handle, t_posted, t_completed or 0.0] of posted exchanges
        self.verified: set = set()  # schedules whose ep_comm order was checked (executor)

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """(k, E) int64 -> (dp*cp*tp, k, E) in global token order (the routing counts of
        every rank that holds tokens of this global microbatch)."""
        t = self.topo
        k, E = counts.shape
        tp_all = counts.new_empty((t.tp_size * k, E))
        t.tp_comm.allgather(counts.contiguous(), tp_all)  # (tp*k, E)
        if t.cp_size > 1:  # the other chunks of the same sequences
            cp_all = counts.new_empty((t.cp_size * t.tp_size * k, E))
            tp_all = t.cp_comm.allgather(tp_all, cp_all)
        R = t.dp_size * t.cp_size * t.tp_size
        out = counts.new_empty((R * k, E))
        t.dp_comm.allgather(tp_all, out)
        return out.view(R, k, E)

    def exchange_counts(self, send: np.ndarray) -> np.ndarray:
        """(ep, E_local) rows for each peer's experts -> rows each peer sends here."""
        flat = np.ascontiguousarray(send, dtype=np.int64).reshape(-1)
        return self.group.alltoall_counts(flat).reshape(send.shape)

    def dispatch(self, x, send_rows, recv_rows):
        return _AllToAll.apply(x, self, send_rows, recv_rows)

    def combine(self, y, send_rows, recv_rows):
        return _AllToAll.apply(y, self, send_rows, recv_rows)

    # -- the exchange itself, blocking or posted --------------------------------------------
    def blocking(self, x: torch.Tensor, send_rows, recv_rows) -> torch.Tensor:
        """``send_rows[j]`` rows of ``x`` (m, C) to peer j -> (sum recv_rows, C)."""
        if self.group.size == 1:
            return x.clone()
        self.progress()
        out = x.new_empty((int(np.sum(recv_rows)), *x.shape[1:]))
        t0 = time.perf_counter()
        self.group.alltoallv(x.contiguous(), send_rows, out, recv_rows)
        dt = time.perf_counter() - t0
        self._account(dt, dt)  # blocking: all of it exposed
        return out

    def post(self, rows, send_rows, recv_rows, leaf: bool = False):
        """Post the exchange of ``rows`` nonblocking: (Handle or None, finish) where
        ``finish()`` (after the handle completed) returns the received rows, joined to the
        graph of ``rows`` (backward: the blocking inverse exchange) or, with ``leaf``, as a
        new leaf (the schedule then runs the backward exchange itself)."""
        if self.group.size == 1:
            if leaf:
                return None, lambda: rows.detach().clone().requires_grad_(rows.requires_grad)
            return None, lambda: rows.clone()
        send = rows.detach().contiguous()
        buf = rows.new_empty((int(np.sum(recv_rows)), *rows.shape[1:]))
        handle = self.group.ialltoallv(send, send_rows, buf, recv_rows)
        self.pending.append([handle, time.perf_counter(), 0.0])
        if leaf:
            return handle, lambda: buf.requires_grad_(rows.requires_grad)
        return handle, lambda: _Received.apply(rows, buf, self, send_rows, recv_rows)

    def progress(self) -> None:
        """Drive MPI progress of the posted exchanges (``Handle.test``); not collective."""
        for entry in self.pending:
            if not entry[2] and entry[0].test():
                entry[2] = time.perf_counter()

    def wait(self, handle) -> None:
        """Complete a posted exchange, accounting its busy and exposed seconds."""
        entry = next(e for e in self.pending if e[0] is handle)
        self.pending.remove(entry)
        t0 = time.perf_counter()
        handle.wait()
        t1 = time.perf_counter()
        self._account((entry[2] or t1) - entry[1], t1 - t0)

    def _account(self, busy: float, exposed: float) -> None:
        self.a2a["busy"] += busy
        self.a2a["exposed"] += exposed
        self.a2a["calls"] += 1

    def take_a2a(self) -> tuple[float, float]:
        """(busy, exposed) all-to-all seconds since the last call; resets them."""
        out = self.a2a["busy"], self.a2a["exposed"]
        self.a2a.update(busy=0.0, exposed=0.0, calls=0)
        return out


def ffn_factory(model_cfg, topo, ops):
    """``layer -> MoE`` for expert layers (every ``moe_every``-th), ``None`` (dense MLP)
    otherwise. Called by ``parallel.build_model`` when ``model.num_experts > 0``."""
    exchange = ExpertExchange(topo)
    dtype = DTYPES[model_cfg.dtype]
    resid_std = model_cfg.init_std / (2 * model_cfg.n_layers) ** 0.5

    def make(layer: int):
        if not model_cfg.moe_layer(layer):
            return None
        return MoE(model_cfg, ops, exchange, dtype, resid_std)

    return make


class MoeStep:
    """The MoE side of a training step, for the loop (a dense model's does nothing): the
    selection biases a checkpoint holds (:attr:`state`), their move after the update
    (:meth:`after_update`), and the step's statistics (:meth:`metrics`: collective on logging
    steps; otherwise this rank's counters restart, nothing is exchanged)."""

    def __init__(self, chunks, topo):
        self.chunks, self.topo = chunks, topo
        self.state = route_biases(chunks)  # [(global name, tensor)], saved beside params

    def after_update(self, applied: bool) -> None:
        """Aux-loss-free balancing: every bias follows the step's load (not when the step
        was skipped). Not collective."""
        update_route_bias(self.chunks, applied)

    def metrics(self, logged: bool) -> dict:
        """``step_metrics`` on a logging step (collective over the world and pp_comm, alike
        on every rank); {} otherwise, the step's counters dropped locally."""
        if logged:
            return step_metrics(self.chunks, self.topo)
        for layer in moe_layers(self.chunks).values():
            layer.stats.reset()
        exchange = exchange_of(self.chunks)
        if exchange is not None:
            exchange.take_a2a()
        return {}


def route_biases(chunks) -> list:
    """[(global name, tensor)] of the MoE layers' selection biases on this rank (auxiliary-
    loss-free balancing): state a checkpoint holds beside the parameters, replicated like a
    router (``p.hp`` says so), never trained."""
    out = []
    for i, layer in sorted(moe_layers(chunks).items()):
        if layer.route_bias is not None:
            layer.route_bias.hp = ParamMeta(tuple(layer.route_bias.shape), init="zeros")
            out.append((f"blocks.{i}.mlp.route_bias", layer.route_bias))
    return out


def update_route_bias(chunks, applied: bool = True) -> None:
    """After the optimizer step: every MoE layer moves its selection bias by the step's load
    (not when the step was skipped: ``applied`` False). The load is global already
    (``gather_counts`` summed every rank's counts over tp, cp and dp, ep included), so every
    rank holding a layer moves its bias alike; no communication."""
    for layer in moe_layers(chunks).values():
        layer.update_bias(applied)


def step_metrics(chunks, topo) -> dict:
    """This step's MoE statistics for metrics.jsonl, then reset. Collective over the world
    and pp_comm; returns {} on dense models (every rank agrees).

    ``moe_load`` / ``moe_dropped``: {layer: per-expert assignments routed / dropped, summed
    over the step's global microbatches}; ``moe_aux_loss`` / ``moe_z_loss``: sum over layers
    of the mean over microbatches (the terms the coefficients multiply); ``moe_a2a_s`` /
    ``_exposed_s`` / ``_hidden_s``: token all-to-all seconds per rank (mean over ranks): in
    flight, waited for, and hidden behind other microbatches' compute (schedule overlap).
    A posted exchange counts as complete when an ``ExpertExchange.progress()`` call (after
    each block and each backward segment) or its wait sees it, so ``hidden`` is an upper
    bound at that granularity."""
    layers = moe_layers(chunks)
    if not layers and topo.pp_size == 1:
        return {}
    mine = {}
    local = np.zeros(2)
    for i, layer in sorted(layers.items()):
        st = layer.stats
        mine[i] = (st.load.tolist(), st.dropped.tolist())
        local += [st.aux / max(st.microbatches, 1), st.z / max(st.microbatches, 1)]
        st.reset()
    merged = {}
    for part in topo.pp_comm.allgather_obj(mine):
        merged.update(part)
    if not merged:
        return {}
    # aux/z: tokens are split over dp x tp and layers over pp: the world sum counts each once.
    aux, z = topo.world.allreduce_array(local)
    exchange = exchange_of(chunks)
    mine_a2a = exchange.take_a2a() if exchange is not None else (0.0, 0.0)
    a2a = topo.world.allreduce_array(np.array(mine_a2a)) / topo.world_size
    return {"moe_a2a_s": float(a2a[0]), "moe_a2a_exposed_s": float(a2a[1]),
            "moe_a2a_hidden_s": float(a2a[0] - a2a[1]),
            "moe_load": {str(i): v[0] for i, v in sorted(merged.items())},
            "moe_dropped": {str(i): v[1] for i, v in sorted(merged.items())},
            "moe_dropped_total": int(sum(sum(v[1]) for v in merged.values())),
            "moe_aux_loss": float(aux), "moe_z_loss": float(z)}
