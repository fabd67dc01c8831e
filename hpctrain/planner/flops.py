"""Model FLOPs per token (for MFU) and a matmul probe (the rate a rank achieved).

Model FLOPs count the multiply-adds the model *needs* (2 FLOPs each), not what the hardware
did: activation recomputation, padding and communication are not counted, so
``MFU = achieved model FLOP/s / nominal peak FLOP/s`` is comparable across layouts (the
peak: ``telemetry.peak_flops`` or the cluster description's, never the probe).

Per token, forward, with ``C = d_model``, ``F = ffn_dim``, ``V = vocab_size``, ``T = seq_len``,
``L = n_layers``, ``E = num_experts``, ``k = top_k``; the block terms are the model family's
(``model.families``, :meth:`Family.flop_terms`)::

    attention projections   2 * 2 * C * (C + kv * hd)   (wq, wo; wk, wv: kv heads of hd,
                                                         C for multi-head attention)
    attention core          2 * 2 * C * ctx             (QK^T and AV over ctx keys)
                            ctx = (T + 1) / 2 causal    (mean keys a query sees; the full-T
                                                         convention of PaLM's 12*L*C*T counts
                                                         the masked half too: causal=False)
    dense MLP               2 * m * C * F               (m weight matrices: 2 for w1, w2;
                                                         3 gated, as SwiGLU: w1, w3, w2)
    MoE layer               2 * C * E  +  k * 2 * m * C * Fe  +  2 * m * C * Fs  (+ 2 * C)
                            (router, the k active experts of Fe = expert_dim, the shared
                             experts of Fs = shared_dim, their gate when configured)
    LM head                 2 * C * V                   (embedding lookup: 0)

Training = 3 x forward (backward costs two matmuls per forward matmul). MoE layers are the
blocks ``ModelConfig.moe_layer`` names (past ``dense_layers``, every ``moe_every``-th) when
``num_experts > 0``; every token is counted with its ``k``
experts (tokens a capacity limit drops are still counted: the model asks for them).
"""

from __future__ import annotations

from ..config import ModelConfig
from ..model.families import family_of


def moe_layer_count(m: ModelConfig) -> int:
    """How many of the ``n_layers`` blocks carry a mixture of experts."""
    return sum(1 for i in range(m.n_layers) if m.moe_layer(i))


def forward_flops_per_token(m: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Forward model FLOPs for one token (see the module docstring for the formula)."""
    ctx = (seq_len + 1) / 2 if causal else seq_len
    terms = family_of(m).flop_terms(m, ctx)
    n_moe = moe_layer_count(m)
    n_dense = m.n_layers - n_moe
    return (m.n_layers * terms.attention + n_dense * terms.dense_mlp + n_moe * terms.moe_mlp
            + 2 * m.d_model * m.vocab_size + mtp_flops(m, terms))


def mtp_flops(m: ModelConfig, terms) -> float:
    """Forward FLOPs per token of the multi-token-prediction modules (``model/mtp.py``):
    each a block (index ``n_layers + k - 1``), its projection (C x 2C) and the head."""
    C = m.d_model
    return sum(terms.attention + (terms.moe_mlp if m.moe_layer(i) else terms.dense_mlp)
               + 2 * C * 2 * C + 2 * C * m.vocab_size
               for i in range(m.n_layers, m.n_layers + m.mtp_depth))


def train_flops_per_token(m: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Forward + backward model FLOPs for one token: 3 x forward."""
    return 3.0 * forward_flops_per_token(m, seq_len, causal)
