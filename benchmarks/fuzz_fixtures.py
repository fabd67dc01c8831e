"""The real files the foreign-checkpoint fuzz campaign (:mod:`benchmarks.fuzz_foreign`)
mutates, each written by its format's own writer for ``share/configs/tiny-llama.toml``'s model
at two layers (``--set model.n_layers=2``: every kind of tensor and entry the eight layers
have, in a quarter of the time a conversion takes):

- ``titan``: torchtitan's Llama 3 names saved by torch's DCP writer
  (``torch.distributed.checkpoint.save(..., no_dist=True)``): ``.metadata`` (a pickle) and
  ``__0_0.distcp``;
- ``megatron``: a Megatron-LM save directory (``latest_checkpointed_iteration.txt``,
  ``iter_0000007/``) holding Megatron-Core's names and the distributed optimizer's moments
  saved by the same DCP writer, and ``common.pt``: ``torch.save`` of ``{"args":
  argparse.Namespace(...), "iteration": 7, ...}`` as Megatron-LM writes it;
- ``hf``: a Llama saved by transformers' ``save_pretrained`` in safetensors shards with
  ``model.safetensors.index.json``.

:func:`build` writes them, and decoys (the same checkpoints with other values, placed where a
crafted path could point) once per campaign. Deterministic: the values come from fixed seeds.
"""

from __future__ import annotations

import argparse
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from hpctrain.job.launch import ROOT

CONFIG = ROOT / "share" / "configs" / "tiny-llama.toml"
LAYERS = ("--set", "model.n_layers=2")
ITERATION = 7  # the Megatron save's iteration (and its optimizer's step)
MEGATRON_ITER = f"iter_{ITERATION:07d}"


@dataclass(frozen=True)
class Fixture:
    """One unmutated checkpoint: ``kind``, its directory, and the import command's arguments
    after the source directory (the config for DCP)."""

    kind: str
    path: Path
    args: tuple[str, ...]


def model_config():
    from hpctrain.config import load

    return load(str(CONFIG), [LAYERS[1]]).model


def titan_shapes(m) -> dict[str, tuple]:
    """torchtitan's Llama 3 keys and shapes of model ``m`` (untied head)."""
    hd, kv = m.d_model // m.n_heads, m.n_kv_heads or m.n_heads
    out = {"tok_embeddings.weight": (m.vocab_size, m.d_model), "norm.weight": (m.d_model,),
           "output.weight": (m.vocab_size, m.d_model)}
    for i in range(m.n_layers):
        p = f"layers.{i}."
        out.update({p + "attention.wq.weight": (m.n_heads * hd, m.d_model),
                    p + "attention.wk.weight": (kv * hd, m.d_model),
                    p + "attention.wv.weight": (kv * hd, m.d_model),
                    p + "attention.wo.weight": (m.d_model, m.n_heads * hd),
                    p + "feed_forward.w1.weight": (m.d_ff, m.d_model),
                    p + "feed_forward.w3.weight": (m.d_ff, m.d_model),
                    p + "feed_forward.w2.weight": (m.d_model, m.d_ff),
                    p + "attention_norm.weight": (m.d_model,),
                    p + "ffn_norm.weight": (m.d_model,)})
    return out


def megatron_shapes(m) -> dict[str, tuple]:
    """Megatron-Core GPT keys and shapes (local layer spec: norms as modules of their own;
    q/k/v fused per key/value group, gate and up fused)."""
    hd, kv = m.d_model // m.n_heads, m.n_kv_heads or m.n_heads
    out = {"embedding.word_embeddings.weight": (m.vocab_size, m.d_model),
           "decoder.final_layernorm.weight": (m.d_model,),
           "output_layer.weight": (m.vocab_size, m.d_model)}
    for i in range(m.n_layers):
        p = f"decoder.layers.{i}."
        out.update({p + "input_layernorm.weight": (m.d_model,),
                    p + "self_attention.linear_qkv.weight": ((m.n_heads + 2 * kv) * hd,
                                                             m.d_model),
                    p + "self_attention.linear_proj.weight": (m.d_model, m.n_heads * hd),
                    p + "pre_mlp_layernorm.weight": (m.d_model,),
                    p + "mlp.linear_fc1.weight": (2 * m.d_ff, m.d_model),
                    p + "mlp.linear_fc2.weight": (m.d_model, m.d_ff)})
    return out


def _save_dcp(state: dict, out: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)


def titan_dcp(out: Path, seed: int) -> None:
    """torchtitan's model state (no optimizer: what an ``init_from`` import reads)."""
    g = torch.Generator().manual_seed(seed)
    _save_dcp({k: torch.randn(s, generator=g) for k, s in titan_shapes(model_config()).items()},
              out)


def megatron_args(m) -> argparse.Namespace:
    """A Megatron-LM ``args`` of this model: the fields its checkpoints carry for it."""
    return argparse.Namespace(
        num_layers=m.n_layers, hidden_size=m.d_model, ffn_hidden_size=m.d_ff,
        num_attention_heads=m.n_heads, num_query_groups=m.n_kv_heads,
        group_query_attention=True, kv_channels=m.d_model // m.n_heads,
        padded_vocab_size=m.vocab_size, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
        max_position_embeddings=64, position_embedding_type="rope", rotary_base=10000,
        rotary_percent=1.0, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
        untie_embeddings_and_output_weights=True, add_bias_linear=False,
        params_dtype=torch.float32, bf16=False, fp16=False, lr=3e-4, min_lr=3e-5,
        seed=1234, micro_batch_size=1, global_batch_size=16, seq_length=16,
        ckpt_format="torch_dist", use_distributed_optimizer=True, save="/runs/megatron",
        data_path=["/data/corpus_text_document"], tokenizer_type="GPT2BPETokenizer")


def megatron_common(m) -> dict:
    """What Megatron-LM puts in ``common.pt`` beside its sharded state."""
    return {"args": megatron_args(m), "checkpoint_version": 3.0, "iteration": ITERATION,
            "num_floating_point_operations_so_far": 1.25e12,
            "optimizer": {"param_groups": [{"lr": 3e-4, "step": ITERATION,
                                            "betas": (0.9, 0.95), "eps": 1e-8,
                                            "weight_decay": 0.1}]},
            "opt_param_scheduler": {"max_lr": 3e-4, "min_lr": 3e-5, "num_steps": 112,
                                    "decay_style": "cosine"}}


def megatron_save(out: Path, seed: int) -> None:
    """A Megatron-LM save directory: the model and its Adam moments (DCP), ``common.pt``."""
    m = model_config()
    g = torch.Generator().manual_seed(seed)
    state = {}
    for k, s in megatron_shapes(m).items():
        state[k] = torch.randn(s, generator=g)
        state[f"optimizer.state.exp_avg.{k}"] = torch.randn(s, generator=g) * 1e-3
        state[f"optimizer.state.exp_avg_sq.{k}"] = torch.rand(s, generator=g) * 1e-6
    it = out / MEGATRON_ITER
    _save_dcp(state, it)
    torch.save(megatron_common(m), it / "common.pt")
    (it / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
         "common_backend": "torch", "common_backend_version": 1}))
    (out / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def hf_directory(out: Path, seed: int) -> None:
    """A ``LlamaForCausalLM`` of tiny-llama's widths saved by transformers in shards."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    m = model_config()
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.d_ff,
        num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=64, initializer_range=0.1, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, max_shard_size="20KB")


WRITERS = {"titan": titan_dcp, "megatron": megatron_save, "hf": hf_directory}


def build(root: Path) -> dict[str, Fixture]:
    """Write every fixture under ``root/<kind>`` and its decoy (other values, seed + 1000)
    under ``root/decoys/<kind>``; returns kind -> Fixture."""
    for kind, write in WRITERS.items():
        write(root / kind, seed=1)
        write(root / "decoys" / kind, seed=1001)
    dcp_args = ("--format", "dcp", "--config", str(CONFIG), *LAYERS)
    return {"titan": Fixture("titan", root / "titan", dcp_args),
            "megatron": Fixture("megatron", root / "megatron", dcp_args),
            "hf": Fixture("hf", root / "hf", ("--format", "hf"))}
