"""The Qwen mixture-of-experts families, in the conventions of Hugging Face's
``Qwen3MoeForCausalLM`` and ``Qwen2MoeForCausalLM`` so that weights map 1:1: the llama form
(``llama.py``: RMSNorm, rotary positions, grouped-query attention, SwiGLU) whose feed-forward
layers are routed experts of ``expert_d_ff`` (HF ``moe_intermediate_size``) every
``moe_every``-th block (HF ``decoder_sparse_step``; the other blocks keep a dense SwiGLU MLP
of ``d_ff``, HF ``intermediate_size``). The router's softmax runs in float32 for 16-bit
models; the top-k gates are renormalised as ``norm_topk_prob`` says ("auto": always, as
Mixtral).

- ``qwen3_moe``: RMSNorm over each query and key head before rotary (``model.qk_norm``), no
  attention biases, heads of any size (``model.d_head``), no shared experts
  (``model.family = "qwen3_moe"``; older configs: ``num_experts > 0`` and ``qk_norm``).
- ``qwen2_moe``: biases on the query, key and value projections (``model.qkv_bias``), one
  shared expert of ``shared_expert_d_ff`` beside the routed ones, its output scaled by
  ``sigmoid(x @ shared_gate.T)`` (``model.family = "qwen2_moe"``; older configs:
  ``num_experts > 0``, ``shared_expert_gate``, ``qkv_bias`` and no q/k norms).

What HF can express and these families cannot (an ``mlp_only_layers`` list, sliding windows,
rope scaling, an output-projection bias) is refused on import; what hpctrain's experts can do
and the HF classes cannot (dropping tokens, sigmoid scores, a scaling factor, a selection
bias, group-limited routing) is refused on export.
"""

from __future__ import annotations

from ...config import ModelConfig
from .llama import LlamaForm
from .mixtral import Mixtral, MixtralForm
from .qwen import full_attention_refusal, head_size

HF_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}  # hpctrain -> HF MLP


class Qwen3MoeForm(MixtralForm):
    """Hugging Face's ``Qwen3MoeForCausalLM`` (llama's form where a block is dense)."""

    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"

    def refusal(self, m: ModelConfig) -> str | None:
        if m.qkv_bias:
            return (f"model.qkv_bias = true: {self.architecture}'s attention_bias also "
                    f"puts a bias on the output projection, which hpctrain has not; export "
                    f"--format safetensors")
        if m.shared_experts:
            return (f"model.shared_experts = {m.shared_experts}: {self.architecture} has "
                    f"no shared experts (Qwen2-MoE has one, gated, without q/k norms)")
        return self.moe_refusal(m)

    def moe_refusal(self, m: ModelConfig) -> str | None:
        """What the experts of ``m`` do that the HF class cannot express."""
        groups = 0 < m.route_top_groups < m.route_groups
        for bad, what in ((m.capacity_factor > 0, f"model.capacity_factor = "
                           f"{m.capacity_factor} (HF routes every token)"),
                          (m.router_score != "softmax", f"model.router_score = "
                           f"{m.router_score!r} (HF: softmax)"),
                          (m.routed_scaling_factor != 1, f"model.routed_scaling_factor = "
                           f"{m.routed_scaling_factor} (HF: 1)"),
                          (m.bias_update_rate > 0, f"model.bias_update_rate = "
                           f"{m.bias_update_rate} (HF has no selection bias)"),
                          (groups, f"model.route_top_groups = {m.route_top_groups} (HF "
                           f"routes over all experts)")):
            if bad:
                return self.differs(what, "route differently")
        return None

    def differs(self, what: str, how: str) -> str:
        """The refusal of an export whose ``what`` makes the HF class ``how``."""
        return (f"{what}: {self.architecture} would {how}, so the logits would differ; "
                f"export --format safetensors")

    def renormalises(self, m: ModelConfig) -> bool:
        """Whether the top-k gates are renormalised (HF ``norm_topk_prob``)."""
        return {"true": True, "false": False}.get(m.norm_topk_prob,
                                                  m.top_k > 1 or self.family.renormalize_top1)

    def ffn_names(self, m: ModelConfig, b: str, L: str, i: int) -> list:
        """A dense block's MLP as llama's; an expert block's router, then one entry per
        expert slice ``[e]`` of the stacked (E, ...) tensors."""
        if not m.moe_layer(i):
            return LlamaForm.ffn_names(self, m, b, L, i)
        return [(b + "mlp.router", L + "mlp.gate.weight", None)] + [
            (b + f"mlp.{w}", L + f"mlp.experts.{e}.{HF_EXPERT[w]}.weight", e)
            for e in range(m.num_experts) for w in ("w1", "w3", "w2")]

    def config_extra(self, m: ModelConfig) -> dict:
        return {"attention_bias": False, "attention_dropout": 0.0,
                "num_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                "moe_intermediate_size": m.expert_dim, "decoder_sparse_step": m.moe_every,
                "mlp_only_layers": [], "norm_topk_prob": self.renormalises(m),
                "router_aux_loss_coef": m.aux_loss_coef, "output_router_logits": False,
                "use_sliding_window": False, "sliding_window": None}

    def head_dim_refusal(self, hf: dict) -> str | None:
        return None  # heads of any size: model.d_head

    def import_refusal(self, hf: dict) -> str | None:
        refusal = super().import_refusal(hf) or full_attention_refusal(hf)
        if refusal is None and hf.get("mlp_only_layers"):
            refusal = (f"mlp_only_layers = {hf['mlp_only_layers']} is not supported: "
                       f"hpctrain puts experts in every decoder_sparse_step-th layer only")
        return refusal

    def section(self, hf: dict) -> dict:
        out = {**LlamaForm.section(self, hf), **head_size(hf)}
        out.update(num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
                   top_k=int(hf["num_experts_per_tok"]),
                   moe_every=int(hf.get("decoder_sparse_step", 1)), capacity_factor=0.0,
                   expert_d_ff=int(hf["moe_intermediate_size"]),
                   norm_topk_prob=str(bool(hf.get("norm_topk_prob", False))).lower())
        out.update(self.own_section(hf))
        return out

    def own_section(self, hf: dict) -> dict:
        """The [model] keys only this family's HF config.json gives."""
        return {"qk_norm": True}


class Qwen2MoeForm(Qwen3MoeForm):
    """Hugging Face's ``Qwen2MoeForCausalLM``."""

    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"

    def refusal(self, m: ModelConfig) -> str | None:
        return self.moe_refusal(m)

    def ffn_names(self, m: ModelConfig, b: str, L: str, i: int) -> list:
        """Qwen3-MoE's, and in an expert block the shared expert and its gate."""
        out = super().ffn_names(m, b, L, i)
        if m.moe_layer(i):
            out += [(b + f"mlp.shared.{w}", L + f"mlp.shared_expert.{HF_EXPERT[w]}.weight",
                     None) for w in ("w1", "w3", "w2")]
            out.append((b + "mlp.shared_gate", L + "mlp.shared_expert_gate.weight", None))
        return out

    def config_extra(self, m: ModelConfig) -> dict:
        out = super().config_extra(m)
        del out["attention_bias"]
        out.update(qkv_bias=True, shared_expert_intermediate_size=m.shared_dim,
                   sliding_window=0, max_window_layers=m.n_layers,
                   layer_types=["full_attention"] * m.n_layers)
        return out

    def import_refusal(self, hf: dict) -> str | None:
        refusal = super().import_refusal(hf)
        if refusal is None and not hf.get("qkv_bias", True):
            refusal = ("qkv_bias = false is not supported: hpctrain's Qwen2-MoE has q/k/v "
                       "biases")
        if refusal is None and not hf.get("shared_expert_intermediate_size"):
            refusal = ("shared_expert_intermediate_size = 0 is not supported: hpctrain's "
                       "Qwen2-MoE has one gated shared expert")
        return refusal

    def own_section(self, hf: dict) -> dict:
        return {"qkv_bias": True, "shared_experts": 1,
                "shared_expert_d_ff": int(hf["shared_expert_intermediate_size"]),
                "shared_expert_gate": True}


class Qwen3Moe(Mixtral):
    """Mixtral's layers and routing; its own Hugging Face form."""

    name = "qwen3_moe"
    HF = Qwen3MoeForm


class Qwen2Moe(Qwen3Moe):
    """Qwen3-MoE's layers with q/k/v biases and a gated shared expert (config flags)."""

    name = "qwen2_moe"
    HF = Qwen2MoeForm
