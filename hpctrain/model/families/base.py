"""What a model family decides (:class:`Family`): its layer choices, its FLOP and memory
terms, its config checks and its Hugging Face form (``hf.py``: one mapping object). The
layers (``model/layers.py``), the stage, the FLOP and memory estimates (``planner``), the
interchange and the config checks read these and hold no family knowledge of their own.
Imports only ``config``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...config import Config, ModelConfig
from .hf import HFForm

if TYPE_CHECKING:  # torch is imported by the layers that call a family, not by its checks
    import torch


@dataclass(frozen=True)
class FlopTerms:
    """Forward model FLOPs per token of one block's parts (``planner/flops.py`` sums
    them): ``attention`` (projections and core), ``dense_mlp``, ``moe_mlp`` (router and the
    ``top_k`` active experts)."""

    attention: float
    dense_mlp: float
    moe_mlp: float


class Family:
    """One model family. A family module subclasses it and sets every layer choice; the
    methods derive counts and checks from those choices, and a family overrides one where
    its form differs.

    Layer choices (no defaults: each family states them):

    - ``norm``: the norm of every block and the final norm (``"rmsnorm"``);
    - ``rotary``: rotary position embeddings (False: no positions);
    - ``grouped_query``: ``model.n_kv_heads`` key/value heads (False: as many as query heads);
    - ``gated``: the MLP (and every expert) is ``w2(act(w1 x) * w3 x)`` (False:
      ``w2(act(w1 x))``), with :meth:`activation` as ``act``.

    Expert routing (a family whose configs can have ``num_experts > 0``): the router's softmax
    runs in float32 for the dtypes named in ``router_float32``; with ``model.norm_topk_prob =
    "auto"`` the top-k gates are renormalised to sum to 1 when ``k > 1``, and also for ``k = 1``
    when ``renormalize_top1``.
    """

    name: str  # the family's name (the registry, messages)
    arch: str  # the ``model.arch`` spelling that selects it
    norm: str
    rotary: bool
    grouped_query: bool
    gated: bool
    router_float32: tuple = ("bfloat16",)
    latent_attention: bool = False  # multi-head latent attention (``model/latent.py``)
    selection_bias: bool = False  # every MoE layer has a selection bias, trained or not
    renormalize_top1: bool = False
    experts: bool | None = None  # True: only with model.num_experts > 0; False: only without
    HF: type[HFForm] = HFForm  # its Hugging Face form (the base: none)

    def __repr__(self) -> str:
        return f"<model family {self.name} (model.arch={self.arch!r})>"

    @functools.cached_property
    def hf(self) -> HFForm:
        """The Hugging Face form: names, config.json, refusals (``hf.py``)."""
        return self.HF(self)

    # -- layers -------------------------------------------------------------------------------
    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP's (and experts') activation."""
        raise NotImplementedError

    def kv_heads(self, m: ModelConfig) -> int:
        """Key/value heads of the attention."""
        return m.kv_heads if self.grouped_query else m.n_heads

    def head_dims(self, m: ModelConfig) -> tuple[int, int]:
        """Channels per head of queries and keys, and of values."""
        return m.head_dim, m.head_dim

    def rotary_dim(self, m: ModelConfig) -> int:
        """Channels per head that rotary embeddings turn (the last ones of a head)."""
        return m.head_dim

    def kv_cache_elems(self, m: ModelConfig) -> int:
        """Numbers the KV cache of decoding holds per token and layer."""
        return 2 * self.kv_heads(m) * m.head_dim

    def kv_width(self, m: ModelConfig) -> int:
        """Key and value numbers per token that context parallelism moves."""
        return 2 * self.kv_heads(m) * m.head_dim

    def attention_saved(self, m: ModelConfig) -> tuple[int, int]:
        """Numbers per token autograd saves in attention (cp = 1, no recompute): split over
        tp (q, k and v repeated to the query heads, the output), and on every tp rank."""
        return 4 * m.d_model, 0

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of a (dense or expert) MLP: w1, w2 (gated: and w3)."""
        return 3 if self.gated else 2

    @property
    def mlp_saved(self) -> int:
        """Hidden-sized tensors autograd saves per token in the MLP: the hidden before and
        after the activation (gated: the gate, its activation, the up projection and their
        product)."""
        return 4 if self.gated else 2

    # -- FLOP terms ---------------------------------------------------------------------------
    def flop_terms(self, m: ModelConfig, ctx: float) -> FlopTerms:
        """Forward FLOPs per token of one block's parts, with ``ctx`` keys per query."""
        C, F = m.d_model, m.ffn_dim
        q, kv = m.n_heads * m.head_dim, self.kv_heads(m) * m.head_dim
        attention = 2 * 2 * C * (q + kv) + 2 * 2 * q * ctx
        dense_mlp = 2 * self.mlp_matrices * C * F
        routed = m.top_k * 2 * self.mlp_matrices * C * m.expert_dim
        shared = 2 * self.mlp_matrices * C * m.shared_dim + (2 * C if m.shared_expert_gate else 0)
        return FlopTerms(attention, dense_mlp, 2 * C * m.num_experts + routed + shared)

    # -- memory terms (parameter elements on one rank) -------------------------------------
    def block_params(self, m: ModelConfig, tp: int) -> int:
        """Attention (wq, wk, wv, wo split over tp; the q/k/v biases too; the q/k norms
        replicated) and the block's two norms."""
        C, q, kv = m.d_model, m.n_heads * m.head_dim, self.kv_heads(m) * m.head_dim
        extra = (2 * m.head_dim if m.qk_norm else 0) + ((q + 2 * kv) // tp if m.qkv_bias else 0)
        return 2 * C * (q // tp) + 2 * C * (kv // tp) + 2 * C + extra

    def mlp_params(self, m: ModelConfig, tp: int) -> int:
        """A dense MLP, split over tp on its hidden dimension."""
        return self.mlp_matrices * m.d_model * m.ffn_dim // tp

    def expert_params(self, m: ModelConfig, ep: int, tp: int = 1) -> int:
        """An MoE layer: this rank's routed experts (split over ep, not tp), the router and
        the shared experts (split over tp, as the MLP) with their gate."""
        C, E = m.d_model, m.num_experts
        shared = self.mlp_matrices * C * m.shared_dim // tp + (C if m.shared_expert_gate else 0)
        return self.mlp_matrices * C * m.expert_dim * (E // ep) + C * E + shared

    # -- config checks --------------------------------------------------------------------------
    def check(self, cfg: Config, need) -> None:
        """Report what this family cannot run through ``need(ok, message)``."""
        top, m = cfg.topology, cfg.model
        if self.experts is not None:
            need((m.num_experts > 0) == self.experts,
                 f"model.family={self.name!r} is a family "
                 f"{'with' if self.experts else 'without'} experts, but model.num_experts = "
                 f"{m.num_experts}; set model.num_experts, or another model.family")
        if self.grouped_query:
            kv = self.kv_heads(m)
            need(kv <= 0 or m.n_heads % kv == 0,
                 f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={kv} "
                 "(grouped-query attention: every kv head serves the same number of query "
                 "heads)")
            need(kv <= 0 or kv % top.tp == 0,
                 f"model.n_kv_heads={kv} is not divisible by topology.tp={top.tp} (each tp "
                 "rank holds whole kv heads; kv heads are not replicated)")
        if self.rotary and not self.latent_attention:
            hd = m.d_head or m.d_model // max(m.n_heads, 1)
            size = (f"model.d_head = {hd}" if m.d_head else
                    f"model.d_model/model.n_heads = {m.d_model}/{m.n_heads} = {hd}")
            need(hd % 2 == 0, f"{size} must be even for the {self.name} family (rotary "
                 "embeddings rotate pairs of channels)")
