"""The mixtral family: the llama form (``llama.py``) with mixture-of-experts feed-forward
layers, as Hugging Face's ``MixtralForCausalLM`` / ``MixtralSparseMoeBlock``: the router's
softmax in float32 for 16-bit models, the top-k gates renormalised to sum to 1 for every k,
SwiGLU experts (``w1`` gate, ``w3`` up, ``w2`` down). ``model.family = "mixtral"`` (read from
older configs with ``model.arch = "llama"``, ``num_experts > 0``, no q/k norms, and not both
gated shared experts and q/k/v biases)."""

from __future__ import annotations

from ...config import ModelConfig
from .llama import Llama, LlamaForm


def deepseek_refusal(m: ModelConfig, name: str) -> str | None:
    """The DeepSeek-style expert options (docs/models.md) a Mixtral-form export cannot
    express, as one sentence (None: none is set)."""
    set_ = [f"model.{k} = {v!r}" for k, v, plain in (
        ("shared_experts", m.shared_experts, 0), ("router_score", m.router_score, "softmax"),
        ("routed_scaling_factor", m.routed_scaling_factor, 1.0),
        ("bias_update_rate", m.bias_update_rate, 0.0),
        ("route_top_groups", 0 if m.route_top_groups >= m.route_groups else
         m.route_top_groups, 0),
        ("expert_d_ff", m.expert_dim, m.ffn_dim)) if v != plain]
    if m.norm_topk_prob == "false":
        set_.append("model.norm_topk_prob = 'false'")
    return (f"{', '.join(set_)}: the {name} form in transformers has no such option, so its "
            "logits would differ; export --format safetensors") if set_ else None


class MixtralForm(LlamaForm):
    """Hugging Face's ``MixtralForCausalLM``."""

    model_type = "mixtral"
    architecture = "MixtralForCausalLM"

    def refusal(self, m: ModelConfig) -> str | None:
        refusal = super().refusal(m)
        if refusal is not None:
            return refusal
        if m.moe_every != 1:
            return (f"model.moe_every = {m.moe_every}: only models where every block is a "
                    f"mixture of experts map to Mixtral (moe_every = 1)")
        if m.capacity_factor > 0:
            return (f"model.capacity_factor = {m.capacity_factor}: Mixtral routes every token "
                    f"(dropless); hpctrain would drop tokens, so the logits would differ")
        return deepseek_refusal(m, self.family.name)

    def ffn_names(self, m: ModelConfig, b: str, L: str, i: int) -> list:
        """The router, then one entry per expert slice ``[e]`` of the stacked (E, ...)
        tensors."""
        return [(b + "mlp.router", L + "block_sparse_moe.gate.weight", None)] + [
            (b + f"mlp.{w}", L + f"block_sparse_moe.experts.{e}.{w}.weight", e)
            for e in range(m.num_experts) for w in ("w1", "w2", "w3")]

    def config_extra(self, m: ModelConfig) -> dict:
        return {"num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                "router_aux_loss_coef": m.aux_loss_coef, "router_jitter_noise": 0.0,
                "sliding_window": None, "output_router_logits": False}

    def section(self, hf: dict) -> dict:
        out = super().section(hf)
        out.update(num_experts=int(hf["num_local_experts"]),
                   top_k=int(hf["num_experts_per_tok"]), moe_every=1, capacity_factor=0.0)
        return out


class Mixtral(Llama):
    name = "mixtral"
    arch = "llama"
    router_float32 = ("bfloat16", "float16")
    renormalize_top1 = True
    experts = True
    HF = MixtralForm
