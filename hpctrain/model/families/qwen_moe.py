"""The Qwen mixture-of-experts families, in the conventions of Hugging Face's
``Qwen3MoeForCausalLM`` and ``Qwen2MoeForCausalLM`` so that weights map 1:1: the llama form
(``llama.py``: RMSNorm, rotary positions, grouped-query attention, SwiGLU) whose feed-forward
layers are experts every ``moe_every``-th block (HF's ``decoder_sparse_step``; the other
blocks keep a dense SwiGLU MLP of ``d_ff``). The router's softmax runs in float32 for 16-bit
models; top-k gates are renormalised to sum to 1 as ``norm_topk_prob`` says.

- ``qwen3_moe``: RMSNorm over each query and key head before rotary (``model.qk_norm``), no
  attention biases, heads of any size (``model.d_head``), no shared experts. Selected by
  ``model.arch = "llama"`` with ``num_experts > 0`` and ``qk_norm``.

What HF can express and these families cannot (an ``mlp_only_layers`` list, sliding windows,
rope scaling, biases other than q/k/v) is refused on import.
"""

from __future__ import annotations

from ...config import ModelConfig
from .llama import Llama


def expert_ffn(m: ModelConfig) -> int:
    """The hidden size of one routed expert."""
    return getattr(m, "expert_d_ff", 0) or m.ffn_dim


def moe_block(m: ModelConfig, i: int) -> bool:
    """Whether block ``i`` has experts (HF: ``(i + 1) % decoder_sparse_step == 0``)."""
    return m.num_experts > 0 and (i + 1) % m.moe_every == 0


class Qwen3Moe(Llama):
    name = "qwen3_moe"
    arch = "llama"
    router_float32 = ("bfloat16", "float16")
    renormalize_top1 = True
    hf_model_type = "qwen3_moe"
    hf_architecture = "Qwen3MoeForCausalLM"

    def claims(self, m: ModelConfig) -> bool:
        return m.num_experts > 0 and m.qk_norm

    # -- Hugging Face form ------------------------------------------------------------------
    def hf_refusal(self, m: ModelConfig) -> str | None:
        if m.qkv_bias:
            return (f"model.qkv_bias = true: {self.hf_architecture}'s attention_bias also "
                    f"puts a bias on the output projection, which hpctrain has not; export "
                    f"--format safetensors")
        return self.hf_moe_refusal(m)

    def hf_moe_refusal(self, m: ModelConfig) -> str | None:
        """What the experts of ``m`` have that the HF class cannot express."""
        if m.capacity_factor > 0:
            return (f"model.capacity_factor = {m.capacity_factor}: {self.hf_architecture} "
                    f"routes every token (dropless); hpctrain would drop tokens, so the "
                    f"logits would differ")
        return None

    def hf_ffn_names(self, m: ModelConfig, b: str, L: str, i: int) -> list:
        """A dense block's MLP as llama's; an expert block's router, then one entry per
        expert slice ``[e]`` of the stacked (E, ...) tensors."""
        if not moe_block(m, i):
            return super().hf_ffn_names(m, b, L, i)
        hf = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
        return [(b + "mlp.router", L + "mlp.gate.weight", None)] + [
            (b + f"mlp.{w}", L + f"mlp.experts.{e}.{hf[w]}.weight", e)
            for e in range(m.num_experts) for w in ("w1", "w3", "w2")]

    def hf_config_extra(self, m: ModelConfig) -> dict:
        return {"attention_bias": False, "attention_dropout": 0.0,
                "num_experts": m.num_experts, "num_experts_per_tok": m.top_k,
                "moe_intermediate_size": expert_ffn(m), "decoder_sparse_step": m.moe_every,
                "mlp_only_layers": [], "norm_topk_prob": True,
                "router_aux_loss_coef": m.aux_loss_coef, "output_router_logits": False,
                "use_sliding_window": False, "sliding_window": None}

    def hf_head_dim_refusal(self, hf: dict) -> str | None:
        return None  # heads of any size: model.d_head

    def hf_import_refusal(self, hf: dict) -> str | None:
        refusal = super().hf_import_refusal(hf)
        if refusal is not None:
            return refusal
        if hf.get("mlp_only_layers"):
            return (f"mlp_only_layers = {hf['mlp_only_layers']} is not supported: hpctrain "
                    f"puts experts in every decoder_sparse_step-th layer only")
        if not hf.get("norm_topk_prob", False):
            return ("norm_topk_prob = false is not supported yet: hpctrain renormalises the "
                    "top-k gates")
        sparse = int(hf.get("decoder_sparse_step", 1))
        if sparse > 1 and hf["moe_intermediate_size"] != hf["intermediate_size"]:
            return (f"moe_intermediate_size = {hf['moe_intermediate_size']} beside dense "
                    f"layers of intermediate_size = {hf['intermediate_size']} "
                    f"(decoder_sparse_step = {sparse}) is not supported")
        return None

    def hf_section(self, hf: dict) -> dict:
        out = super().hf_section(hf)
        hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or hidden // heads)
        sparse = int(hf.get("decoder_sparse_step", 1))
        out.update(num_experts=int(hf.get("num_experts", hf.get("num_local_experts", 0))),
                   top_k=int(hf["num_experts_per_tok"]), moe_every=sparse,
                   capacity_factor=0.0, qk_norm=True,
                   d_head=0 if head_dim * heads == hidden else head_dim,
                   d_ff=int(hf["moe_intermediate_size"] if sparse == 1
                            else hf["intermediate_size"]))
        return out
