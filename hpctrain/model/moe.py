"""Mixture-of-experts feed-forward layer in plain PyTorch. Imports no MPI.

Routing (per token): router logits ``x @ router.T`` (E,), scores (softmax, or sigmoid with
``model.router_score``), top-k experts (``model/routing.py``: optionally by the scores plus
the selection bias of auxiliary-loss-free balancing, among the best ``route_top_groups`` of
``route_groups`` groups), weighted by their scores (renormalised per ``norm_topk_prob``,
times ``routed_scaling_factor``). The model's family (``model/families/``) decides the rest:
for which dtypes the scores are computed in float32 (``router_float32``), whether the top-1
gate is renormalised too when ``norm_topk_prob = "auto"`` (``renormalize_top1``; k > 1
gates then sum to 1), and the experts' MLP (``gated``, ``activation``). Shared experts
(``model.shared_experts``) are one MLP every token goes through, added to the routed output.
gpt: the gate is the softmax probability (k = 1), GELU experts; mixtral (as
Hugging Face's ``MixtralSparseMoeBlock``): the softmax in float32 for 16-bit models, the gates
renormalised for every k, SwiGLU experts (``w1`` gate, ``w3`` up, ``w2`` down).
The layer output is ``sum_kept gate * expert(x)``; a dropped assignment adds 0 (the block's
residual carries the token on).

Everything that crosses ranks is injected, like the ``ops`` object of tensor parallelism:
``exchange`` (:class:`LocalExchange` here, ``parallel.moe_exchange.ExpertExchange``, MPI) moves
tokens to the experts' ranks and back and gathers routing counts. The tp split uses ``ops``:
each tp rank routes a contiguous ``1/tp`` slice of the tokens and returns zeros elsewhere, so
the block's ``exit_tp`` (a sum over tp) restores the full output.

**The global microbatch.** Load-balancing statistics and capacity are defined over the
*global microbatch*: the ``dp * micro_batch_size`` sequences that all data-parallel (and tp)
ranks process as microbatch ``j`` (``data.Sampler``). A one-rank run with
``micro_batch_size = dp * mbs`` sees exactly those tokens in one microbatch, in the same order
(dp rank major, then tp slice, then position) - the "global token order".

* Load-balancing loss (Switch): ``aux_j = E * sum_e f_e * P_e`` with ``f_e`` = fraction of the
  ``N_j * k`` assignments routed to ``e`` and ``P_e`` = mean router probability of ``e`` over
  the ``N_j`` tokens. Router z-loss: ``z_j = mean_t logsumexp(logits_t)^2``.
  The objective is ``mean token CE + sum_layers mean_j (aux_coef * aux_j + z_coef * z_j)``.
  Since train.py scales losses by ``1 / global tokens`` (times float16's loss scale, which
  every gradient is divided by later) and ``N_j * microbatches`` = global tokens, each rank
  injects the gradient of ``loss_scale * (aux_coef * E * sum_e f_e *
  sum_{local t} p_te + z_coef * sum_{local t} lse_t^2)``: only ``f_e`` (counts, no gradient)
  needs the gather; the rest is local and sums to the global objective.
* Capacity (``capacity_factor > 0``): each expert accepts at most
  ``ceil(capacity_factor * N_j * k / E)`` assignments per global microbatch. Priority is
  the global order: every token's first choice before any second choice (GShard), then
  global token order. Each rank derives its tokens' global positions from the gathered
  per-rank counts, so every layout drops exactly the tokens one rank drops.
  ``capacity_factor = 0`` is dropless.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from . import routing
from .families import family_of
from .layers import MLP, ParamMeta, _param
from .steps import Exchange, drive
from .weight_grad import linear


def token_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """Contiguous slice [start, stop) of ``n`` tokens routed by tp rank ``index``."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


class LocalExchange:
    """Single-rank stand-in for the expert-parallel communication (identities).

    ``gather_counts``: this rank's (k, E) assignment counts -> (R, k, E) of the R ranks that
    share the global microbatch, in global token order; ``position`` is this rank's index.
    ``exchange_counts``: (ep, E_local) rows for each peer's experts -> rows from each peer.
    ``dispatch``/``combine``: rows grouped by destination peer -> rows grouped by source.
    """

    ep_size = 1
    ep_rank = 0
    position = 0

    def gather_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return counts.unsqueeze(0)

    def exchange_counts(self, send: np.ndarray) -> np.ndarray:
        return send.copy()

    def dispatch(self, x: torch.Tensor, send_rows, recv_rows) -> torch.Tensor:
        return x

    def combine(self, y: torch.Tensor, send_rows, recv_rows) -> torch.Tensor:
        return y


class _InjectAuxGrad(torch.autograd.Function):
    """Identity on ``x``; backward also feeds ``scale`` as the gradient of the scalar ``aux``
    (the auxiliary losses join the objective without reaching the last pipeline stage)."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=grad.dtype, device=grad.device), None


class MoEStats:
    """Per-step accumulation (the side channel train.py collects): global counts per expert
    (identical on every rank of the dp x tp group) and this rank's share of aux/z losses."""

    def __init__(self, num_experts: int):
        self.E = num_experts
        self.reset()

    def reset(self) -> None:
        self.load = np.zeros(self.E, dtype=np.int64)  # assignments routed, before dropping
        self.dropped = np.zeros(self.E, dtype=np.int64)
        self.aux = 0.0  # sum over microbatches of this rank's part of aux_j
        self.z = 0.0
        self.microbatches = 0


class MoE(nn.Module):
    """E experts (the family's MLPs, batched weights ``w1`` (E, H, C), ``w2`` (E, C, H);
    gated: also ``w3`` (E, H, C); H = ``expert_dim``), of which
    this rank holds ``E / ep`` (``ParamMeta.expert_dim = 0``), and a replicated router;
    optionally ``shared`` (an :class:`~.layers.MLP` split over tp, on every token) with its
    gate ``shared_gate`` (1, C), and the selection bias ``route_bias`` (E,), a buffer.
    Under tp the weights are replicated but each tp rank sees other tokens, so their
    gradients are partial over tp (``sp_partial``)."""

    stepped = True  # Block runs it through :meth:`steps` (it yields at its token exchanges)

    def __init__(self, cfg: ModelConfig, ops, exchange, dtype, resid_std: float):
        super().__init__()
        E, C, H = cfg.num_experts, cfg.d_model, cfg.expert_dim
        if E % exchange.ep_size:
            raise ValueError(f"model.num_experts={E} is not divisible by ep={exchange.ep_size}")
        self.cfg, self.ops, self.exchange = cfg, ops, exchange
        self.E, self.k, self.E_local = E, cfg.top_k, E // exchange.ep_size
        partial = ops.tp_size > 1
        self.router = _param((E, C), ParamMeta((E, C), sp_partial=partial, std=cfg.init_std),
                             dtype)
        self.family = family_of(cfg)
        self.w1 = _param((self.E_local, H, C), ParamMeta(
            (E, H, C), expert_dim=0, sp_partial=partial, std=cfg.init_std), dtype)
        if self.family.gated:  # the up projection of gated experts
            self.w3 = _param((self.E_local, H, C), ParamMeta(
                (E, H, C), expert_dim=0, sp_partial=partial, std=cfg.init_std), dtype)
        self.w2 = _param((self.E_local, C, H), ParamMeta(
            (E, C, H), expert_dim=0, sp_partial=partial, std=resid_std), dtype)
        self.shared = MLP(cfg, ops, dtype, resid_std, cfg.shared_dim) if cfg.shared_dim else None
        if cfg.shared_dim and cfg.shared_expert_gate:  # sigmoid(x . w) on the shared output
            self.shared_gate = _param((1, C), ParamMeta((1, C), sp_partial=partial,
                                                        std=cfg.init_std), dtype)
        self.renormalise = {"true": True, "false": False}.get(
            cfg.norm_topk_prob, self.k > 1 or self.family.renormalize_top1)
        self.routed = np.zeros(E, dtype=np.int64)  # this step's load, for the bias update
        if cfg.bias_update_rate > 0 or self.family.selection_bias:  # state, not trained
            wide = torch.float64 if dtype == torch.float64 else torch.float32
            self.register_buffer("route_bias", torch.zeros(E, dtype=wide), persistent=False)
        else:
            self.route_bias = None
        # (float16 loss scale) / global tokens, the token loss's factor; set every step by
        # the schedule runner (pipeline.runner.run_step, through set_loss_scale)
        self.loss_scale = 0.0
        self.stats = MoEStats(E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, C), same on all tp
        """The layer with blocking exchanges (the driver of :meth:`steps`)."""
        return drive(self.steps(x))

    def steps(self, x: torch.Tensor):
        """The forward as a generator cut at the token exchanges: it yields
        :class:`~hpctrain.model.steps.Exchange` requests and expects the exchanged rows back
        (``gen.send``); returns the output (B, T, C). A driver may post the exchange
        nonblocking and compute something else before sending the rows back."""
        shape, C = x.shape, x.shape[-1]
        flat = x.reshape(-1, C)  # (N, C)
        N = flat.shape[0]
        start, stop = token_range(N, self.ops.tp_size, self.ops.tp_rank)
        y, aux = yield from self.route_and_compute(flat[start:stop])  # (n, C)
        if self.ops.tp_size > 1:  # zeros outside this rank's slice; exit_tp sums over tp
            y = torch.cat([y.new_zeros(start, C), y, y.new_zeros(N - stop, C)])
        if self.shared is not None:  # every token, split over tp like the dense MLP
            y = y + self.shared_output(flat)
        y = _InjectAuxGrad.apply(y, aux, self.loss_scale)
        return y.view(shape)

    def shared_output(self, x: torch.Tensor) -> torch.Tensor:
        """The shared experts of ``x`` (N, C) (this tp rank's part), gated when configured."""
        out = self.shared(x)
        if self.cfg.shared_expert_gate:
            out = out * torch.sigmoid(linear(x, self.shared_gate))
        return out

    # -- routing --------------------------------------------------------------------------
    def route(self, xs: torch.Tensor):
        """Router of ``xs`` (n, C): (logits (n, E), probs (n, E), experts (n, k), gates).
        ``probs``: the scores normalised per token (the load-balancing loss's P); the experts
        and their weights: ``model/routing.py``."""
        cfg = self.cfg
        logits = F.linear(xs, self.router)
        low = str(logits.dtype).removeprefix("torch.") in self.family.router_float32
        wide = logits.float() if low else logits
        sigmoid = cfg.router_score == "sigmoid"
        scores = torch.sigmoid(wide) if sigmoid else torch.softmax(wide, -1)
        expert = routing.select(scores, self.k, self.route_bias, cfg.route_groups,
                                cfg.route_top_groups)  # (n, k), top choice first
        gate = routing.weights(scores, expert, self.renormalise, cfg.routed_scaling_factor)
        probs = scores / scores.sum(-1, keepdim=True) if sigmoid else scores
        return logits, probs, expert, gate.to(xs.dtype)

    def update_bias(self, applied: bool = True) -> None:
        """After a step: move the selection bias by this step's global load (counted by
        :meth:`record` from the gathered counts, the same on every rank holding the layer)
        unless the step was skipped (not ``applied``), then start counting afresh. Not
        collective."""
        if self.route_bias is not None and applied:
            with torch.no_grad():
                self.route_bias.copy_(routing.bias_step(self.route_bias, self.routed,
                                                        self.cfg.bias_update_rate))
        self.routed[:] = 0

    def capacity(self, tokens: int) -> int:
        """Assignments one expert accepts per global microbatch of ``tokens`` tokens."""
        return math.ceil(self.cfg.capacity_factor * tokens * self.k / self.E)

    def keep_mask(self, expert: torch.Tensor, all_counts: torch.Tensor) -> torch.Tensor:
        """(n, k) bool: assignments within capacity in the global priority order (slot, then
        global token order). ``all_counts`` (R, k, E) from ``exchange.gather_counts``."""
        n = expert.shape[0]
        if self.cfg.capacity_factor <= 0 or n == 0:
            return torch.ones_like(expert, dtype=torch.bool)
        glob = all_counts.sum(0)  # (k, E)
        cap = self.capacity(int(glob[0].sum()))
        # Assignments to e ahead of this rank's slot-s ones: all earlier slots, every rank,
        # plus slot s of the ranks before this one in global token order.
        ahead = torch.cumsum(glob, 0) - glob + all_counts[:self.exchange.position].sum(0)
        keep = torch.empty_like(expert, dtype=torch.bool)
        for s in range(self.k):
            onehot = F.one_hot(expert[:, s], self.E)  # (n, E)
            local_pos = (onehot.cumsum(0) - 1).gather(1, expert[:, s:s + 1]).squeeze(1)
            keep[:, s] = ahead[s][expert[:, s]] + local_pos < cap
        return keep

    def route_and_compute(self, xs: torch.Tensor):
        """Route this rank's tokens ``xs`` (n, C), run them through their experts wherever
        those live, return (y (n, C), aux objective term whose gradient is injected)."""
        n, E = xs.shape[0], self.E
        logits, probs, expert, gate = self.route(xs)
        counts = torch.stack([torch.bincount(expert[:, s], minlength=E) for s in range(self.k)])
        all_counts = self.exchange.gather_counts(counts)  # (R, k, E)
        glob = all_counts.sum(0)  # (k, E)
        tokens = int(glob[0].sum())  # N_j: tokens of the global microbatch
        keep = self.keep_mask(expert, all_counts)
        # Aux terms: this rank's share of N_j * aux_j and N_j * z_j (see module docstring).
        f = glob.sum(0).to(probs.dtype) / max(tokens * self.k, 1)  # (E,)
        aux = E * (f * probs.sum(0)).sum()
        z = torch.logsumexp(logits, -1).pow(2).sum()
        self.record(glob, tokens, aux, z)
        total = self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z
        # Kept assignments, sorted by expert (so grouped by destination ep rank).
        tok = torch.arange(n, device=xs.device).unsqueeze(1).expand(n, self.k)[keep]
        exp, g = expert[keep], gate[keep]  # (m,)
        order = torch.sort(exp, stable=True).indices
        tok, exp, g = tok[order], exp[order], g[order]
        out = yield from self.experts_remote(xs[tok], exp)  # (m, C)
        y = xs.new_zeros(n, xs.shape[1]).index_add(0, tok, out * g.unsqueeze(1))
        return y, total.to(xs.dtype)

    def experts_remote(self, rows: torch.Tensor, exp: torch.Tensor) -> torch.Tensor:
        """Rows (m, C) sorted by expert -> expert outputs (m, C) in the same order:
        dispatch to the ranks holding the experts, compute, combine back."""
        ex, El = self.exchange, self.E_local
        send = torch.bincount(exp, minlength=self.E).cpu().numpy().reshape(ex.ep_size, El)
        recv = ex.exchange_counts(send)  # (ep, E_local): rows from each peer per local expert
        send_rows, recv_rows = send.sum(1), recv.sum(1)
        got = yield Exchange(self, "dispatch", rows, send_rows, recv_rows)  # (source, expert)
        perm = torch.as_tensor(_by_expert_order(recv), device=rows.device)
        y = self.experts_local(got[perm], recv.sum(0))  # grouped by local expert
        back = torch.empty_like(y).index_copy(0, perm, y)  # (source peer, expert) order again
        return (yield Exchange(self, "combine", back, recv_rows, send_rows))

    def experts_local(self, h: torch.Tensor, sizes) -> torch.Tensor:
        """Rows (m, C) grouped by local expert with ``sizes`` (E_local,) -> outputs (m, C)."""
        outs, act = [], self.family.activation
        for e, part in enumerate(torch.split(h, [int(s) for s in sizes])):
            if self.family.gated:
                hidden = act(linear(part, self.w1[e])) * linear(part, self.w3[e])
            else:
                hidden = act(linear(part, self.w1[e]))
            outs.append(linear(hidden, self.w2[e]))
        return torch.cat(outs) if outs else h

    def record(self, glob: torch.Tensor, tokens: int, aux, z) -> None:
        """Accumulate this microbatch's statistics (not during a recompute or without grad)."""
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return
        per_expert = glob.sum(0).cpu().numpy()
        self.routed += per_expert
        st = self.stats
        st.load += per_expert
        if self.cfg.capacity_factor > 0:
            st.dropped += np.maximum(per_expert - self.capacity(tokens), 0)
        st.aux += float(aux.detach()) / max(tokens, 1)
        st.z += float(z.detach()) / max(tokens, 1)
        st.microbatches += 1


def _by_expert_order(recv: np.ndarray) -> np.ndarray:
    """Rows received grouped (source peer, local expert) -> index order grouped (local
    expert, source peer). ``recv`` (ep, E_local) row counts."""
    offsets = np.concatenate([[0], np.cumsum(recv.reshape(-1))[:-1]]).reshape(recv.shape)
    idx = [np.arange(offsets[p, e], offsets[p, e] + recv[p, e])
           for e in range(recv.shape[1]) for p in range(recv.shape[0])]
    return np.concatenate(idx).astype(np.int64) if idx else np.zeros(0, dtype=np.int64)


def exchange_of(chunks):
    """The run's expert exchange (shared by every MoE layer of this rank), or None."""
    layers = moe_layers(chunks)
    return next(iter(layers.values())).exchange if layers else None


def moe_layers(chunks) -> dict[int, MoE]:
    """{global layer index: MoE module} on this rank."""
    out = {}
    for chunk in chunks:
        for name, block in getattr(chunk, "blocks", {}).items():
            if isinstance(block.mlp, MoE):
                out[int(name)] = block.mlp
    return out


def set_loss_scale(chunks, loss_scale: float) -> None:
    """The factor the step applies to the token loss (optimizer loss scale / global tokens;
    the scale is 1 unless float16); the MoE layers inject their auxiliary-loss gradients with
    it, so the later division by the loss scale treats both alike. Not collective."""
    for layer in moe_layers(chunks).values():
        layer.loss_scale = loss_scale
