"""The DeepSeek-V3 family (``model.family = "deepseek_v3"``), in the conventions of Hugging
Face's ``DeepseekV3ForCausalLM`` so that weights map 1:1 (the rotary rows permuted):

- multi-head latent attention (``model/latent.py``): queries through a low-rank compression
  (``model.q_lora_rank``; 0: projected directly), keys and values from one latent of
  ``kv_lora_rank`` plus a rotary key of ``qk_rope_dim`` shared by the heads; heads of
  ``qk_nope_dim + qk_rope_dim`` query/key and ``v_head_dim`` value channels;
- the llama form otherwise: RMSNorm, SwiGLU, rotary positions (rotate-half form);
- DeepSeek-V3's mixture of experts past the first ``dense_layers`` blocks (HF
  ``first_k_dense_replace``): sigmoid scores, a selection bias in every MoE layer (HF
  ``e_score_correction_bias``; it moves with ``model.bias_update_rate``), group-limited
  routing (``route_groups``/``route_top_groups``, HF ``n_group``/``topk_group``), the top-k
  weights renormalised and scaled (``routed_scaling_factor``), shared experts of
  ``expert_d_ff * shared_experts`` (HF ``n_shared_experts``).

Hugging Face stores each head's rotary rows of ``q_b_proj``/``q_proj`` and the rotary rows of
``kv_a_proj_with_mqa`` interleaved (``rope_interleave = true``, DeepSeek's own layout);
import reorders them to rotate-half and export back. Multi-token-prediction modules
(``model.mtp_depth``, ``model/mtp.py``) are DeepSeek's layers ``n_layers + k - 1`` (the block,
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and copies of the embedding and head);
an import holds as many as the directory stores. Refused on import: rope scaling (YaRN),
attention biases, other activations. An import trains aux-loss-free as DeepSeek-V3 did (bias
update rate 0.001, no load-balancing or z-loss).
"""

from __future__ import annotations

from ...config import Config, ModelConfig
from .base import FlopTerms
from .llama import LlamaForm
from .mixtral import Mixtral
from .qwen_moe import HF_EXPERT, Qwen3MoeForm

ATTENTION = (("wkv_a", "kv_a_proj_with_mqa.weight"), ("kv_a_norm.weight", "kv_a_layernorm.weight"),
             ("wkv_b", "kv_b_proj.weight"), ("wo", "o_proj.weight"))


def interleaved(width: int) -> list[int]:
    """HF's channel of each rotate-half channel of ``width`` rotary channels stored
    interleaved: pairs (0, 1), (2, 3), ... turn together, so channel ``j`` of the first half
    is HF's ``2 j`` and of the second ``2 j + 1``."""
    return [2 * j for j in range(width // 2)] + [2 * j + 1 for j in range(width // 2)]


def rope_rows(heads: int, plain: int, rope: int) -> tuple[int, ...]:
    """For each row of a tensor of ``heads`` blocks of ``plain`` rows then ``rope`` rotary
    rows, the HF row it is (the rotary rows interleaved)."""
    order = interleaved(rope)
    block = plain + rope
    return tuple(h * block + (r if r < plain else plain + order[r - plain])
                 for h in range(heads) for r in range(block))


class DeepseekV3Form(Qwen3MoeForm):
    """Hugging Face's ``DeepseekV3ForCausalLM``."""

    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"

    def refusal(self, m: ModelConfig) -> str | None:
        refusal = LlamaForm.refusal(self, m)
        if refusal is not None:
            return refusal
        for bad, what in ((m.capacity_factor > 0, f"model.capacity_factor = "
                           f"{m.capacity_factor} (HF routes every token)"),
                          (m.router_score != "sigmoid", f"model.router_score = "
                           f"{m.router_score!r} (HF: sigmoid)"),
                          (m.moe_every != 1, f"model.moe_every = {m.moe_every} (HF: every "
                           f"block past first_k_dense_replace)"),
                          (m.shared_expert_gate, "model.shared_expert_gate = true (HF: "
                           "ungated shared experts)"),
                          (m.shared_experts == 0 or m.shared_dim != m.expert_dim
                           * m.shared_experts, f"shared experts of {m.shared_dim} with "
                           f"expert_d_ff {m.expert_dim} (HF: expert_d_ff * shared_experts, "
                           f"at least one)")):
            if bad:
                return self.differs(what, "compute otherwise")
        return None

    def names(self, m: ModelConfig, hf: dict | None = None) -> list:
        interleave = (hf or {}).get("rope_interleave", True)
        out = super().names(m, hf) + self.mtp_names(m)
        rows = {"attn.wq": rope_rows(m.n_heads, m.qk_nope_dim, m.qk_rope_dim),
                "attn.wkv_a": rope_rows(1, m.kv_lora_rank, m.qk_rope_dim)}
        rows["attn.wq_b"] = rows["attn.wq"]
        return [(n, k, e, rows.get(n.split(".", 2)[-1]) if interleave else None)
                for n, k, e in out]

    def mtp_names(self, m: ModelConfig) -> list:
        """DeepSeek's multi-token-prediction layers after the last block: the block, its
        norms and projection, and copies of the embedding and the head."""
        out = []
        for k in range(1, m.mtp_depth + 1):
            i = m.n_layers + k - 1
            b, L, p = f"blocks.{i}.", f"model.layers.{i}.", f"mtp.{k - 1}."
            out += [(b + "norm1.weight", L + "input_layernorm.weight", None),
                    *self.attention_names(m, b, L),
                    (b + "norm2.weight", L + "post_attention_layernorm.weight", None),
                    *self.ffn_names(m, b, L, i),
                    (p + "enorm.weight", L + "enorm.weight", None),
                    (p + "hnorm.weight", L + "hnorm.weight", None),
                    (p + "eh_proj", L + "eh_proj.weight", None),
                    (p + "norm.weight", L + "shared_head.norm.weight", None),
                    ("embed", L + "embed_tokens.weight", None),
                    ("embed" if m.tie_embeddings else "head", L + "shared_head.head.weight",
                     None)]
        return out

    def stored(self, section: dict, hf: dict, keys) -> dict:
        """``mtp_depth``: the multi-token-prediction layers stored (a config.json may count
        some its directory does not hold, as transformers' own saves do)."""
        depth, n = 0, int(hf["num_hidden_layers"])
        while depth < int(hf.get("num_nextn_predict_layers") or 0) and \
                f"model.layers.{n + depth}.eh_proj.weight" in keys:
            depth += 1
        return {**section, "mtp_depth": depth} if depth else section

    def attention_names(self, m: ModelConfig, b: str, L: str) -> list:
        q = ([("wq_a", "q_a_proj.weight"), ("q_a_norm.weight", "q_a_layernorm.weight"),
              ("wq_b", "q_b_proj.weight")] if m.q_lora_rank else [("wq", "q_proj.weight")])
        return [(b + "attn." + n, L + "self_attn." + k, None) for n, k in (*q, *ATTENTION)]

    def ffn_names(self, m: ModelConfig, b: str, L: str, i: int) -> list:
        if not m.moe_layer(i):
            return LlamaForm.ffn_names(self, m, b, L, i)
        return [(b + "mlp.router", L + "mlp.gate.weight", None),
                (b + "mlp.route_bias", L + "mlp.gate.e_score_correction_bias", None)] + [
            (b + f"mlp.{w}", L + f"mlp.experts.{e}.{HF_EXPERT[w]}.weight", e)
            for e in range(m.num_experts) for w in ("w1", "w3", "w2")] + [
            (b + f"mlp.shared.{w}", L + f"mlp.shared_experts.{HF_EXPERT[w]}.weight", None)
            for w in ("w1", "w3", "w2")]

    def config_extra(self, m: ModelConfig) -> dict:
        return {"head_dim": m.qk_rope_dim, "num_key_value_heads": m.n_heads,
                "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
                "qk_nope_head_dim": m.qk_nope_dim, "qk_rope_head_dim": m.qk_rope_dim,
                "v_head_dim": m.value_dim, "rope_interleave": True,
                "n_routed_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                "moe_intermediate_size": m.expert_dim, "n_shared_experts": m.shared_experts,
                "first_k_dense_replace": m.dense_layers, "n_group": m.route_groups,
                "topk_group": m.route_top_groups or m.route_groups,
                "norm_topk_prob": self.renormalises(m),
                "routed_scaling_factor": m.routed_scaling_factor,
                "attention_bias": False, "attention_dropout": 0.0,
                "num_nextn_predict_layers": m.mtp_depth}

    def import_refusal(self, hf: dict) -> str | None:
        refusal = LlamaForm.import_refusal(self, hf)
        if refusal is None and hf.get("scoring_func", "sigmoid") != "sigmoid":
            refusal = (f"scoring_func = {hf['scoring_func']!r} is not supported: "
                       f"{self.architecture} scores experts by sigmoid")
        if refusal is None and not hf.get("n_shared_experts"):
            refusal = (f"n_shared_experts = {hf.get('n_shared_experts')}: hpctrain's "
                       f"{self.architecture} form has at least one shared expert")
        return refusal

    def head_dim_refusal(self, hf: dict) -> str | None:
        return None  # heads are sized by qk_nope_head_dim, qk_rope_head_dim, v_head_dim

    def section(self, hf: dict) -> dict:
        out = LlamaForm.section(self, hf)
        E, shared = int(hf["n_routed_experts"]), int(hf["n_shared_experts"])
        expert = int(hf["moe_intermediate_size"])
        out.update(n_kv_heads=0, q_lora_rank=int(hf.get("q_lora_rank") or 0),
                   kv_lora_rank=int(hf["kv_lora_rank"]),
                   qk_nope_dim=int(hf["qk_nope_head_dim"]),
                   qk_rope_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
                   num_experts=E, top_k=int(hf["num_experts_per_tok"]), moe_every=1,
                   dense_layers=int(hf.get("first_k_dense_replace") or 0),
                   expert_d_ff=expert, shared_experts=shared, shared_expert_d_ff=expert * shared,
                   router_score="sigmoid", capacity_factor=0.0,
                   routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                   route_groups=int(hf.get("n_group") or 1),
                   route_top_groups=int(hf.get("topk_group") or 0),
                   norm_topk_prob=str(bool(hf.get("norm_topk_prob", False))).lower(),
                   bias_update_rate=0.001, aux_loss_coef=0.0, z_loss_coef=0.0)
        return out


class DeepseekV3(Mixtral):
    """Latent attention and DeepSeek-V3's experts (module docstring)."""

    name = "deepseek_v3"
    grouped_query = False
    latent_attention = True
    selection_bias = True
    renormalize_top1 = False
    HF = DeepseekV3Form

    def head_dims(self, m: ModelConfig) -> tuple[int, int]:
        return m.qk_nope_dim + m.qk_rope_dim, m.value_dim

    def rotary_dim(self, m: ModelConfig) -> int:
        return m.qk_rope_dim

    def kv_cache_elems(self, m: ModelConfig) -> int:
        """The latent and the rotary key (``latent.py``)."""
        return m.kv_lora_rank + m.qk_rope_dim

    def kv_width(self, m: ModelConfig) -> int:
        """Keys and values of every head, the values padded to the key width."""
        return 2 * m.n_heads * self.head_dims(m)[0]

    def attention_saved(self, m: ModelConfig) -> tuple[int, int]:
        """Split: q, k, v and the output of every head. Every tp rank: the query latent
        before and after its norm, the joint latent and rotary key, the latent normed."""
        qk, v = self.head_dims(m)
        return (2 * m.n_heads * (qk + v),
                2 * m.q_lora_rank + 2 * m.kv_lora_rank + m.qk_rope_dim)

    def flop_terms(self, m: ModelConfig, ctx: float) -> FlopTerms:
        """Latent attention's projections and core; the MLPs as Mixtral's."""
        C, H, r, ql = m.d_model, m.n_heads, m.kv_lora_rank, m.q_lora_rank
        qk, v = self.head_dims(m)
        q = C * ql + ql * H * qk if ql else C * H * qk
        projections = q + C * (r + m.qk_rope_dim) + r * H * (m.qk_nope_dim + v) + H * v * C
        dense = super().flop_terms(m, ctx)
        return FlopTerms(2 * projections + 2 * H * (qk + v) * ctx, dense.dense_mlp,
                         dense.moe_mlp)

    def block_params(self, m: ModelConfig, tp: int) -> int:
        """The down projections and their norms on every tp rank; the up projections and
        ``wo`` split over tp; the block's two norms."""
        C, H, r, ql = m.d_model, m.n_heads, m.kv_lora_rank, m.q_lora_rank
        qk, v = self.head_dims(m)
        replicated = (ql * C + ql if ql else 0) + C * (r + m.qk_rope_dim) + r
        split = (ql or C) * H * qk + r * H * (m.qk_nope_dim + v) + H * v * C
        return replicated + split // tp + 2 * C

    def check(self, cfg: Config, need) -> None:
        super().check(cfg, need)
        top, m = cfg.topology, cfg.model
        for key in ("kv_lora_rank", "qk_nope_dim", "qk_rope_dim"):
            need(getattr(m, key) > 0, f"model.{key} = {getattr(m, key)}: the {self.name} "
                 f"family's latent attention needs it > 0 (DeepSeek-V3: kv_lora_rank 512, "
                 f"qk_nope_dim 128, qk_rope_dim 64)")
        need(m.qk_rope_dim % 2 == 0, f"model.qk_rope_dim = {m.qk_rope_dim} must be even "
             "(rotary embeddings rotate pairs of channels)")
        for key in ("qk_norm", "qkv_bias"):
            need(not getattr(m, key), f"model.{key} = true: the {self.name} family's latent "
                 "attention has no q/k norms or biases; set it false")
        qk, v = self.head_dims(m)
        need(top.cp == 1 or v <= qk, f"model.v_head_dim = {v} > qk_nope_dim + qk_rope_dim "
             f"= {qk} with topology.cp = {top.cp}: context parallelism pads values to the "
             "key width; lower v_head_dim or set cp = 1")
