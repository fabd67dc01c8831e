"""A real Megatron-Core ``torch_dist`` checkpoint, written by Megatron-Core's own
``dist_checkpointing.save`` on this CPU machine, for tests/e2e/test_megatron_import.py.

``python tests/e2e/megatron_writer.py OUT [--optimizer fully_reshardable|dp_reshardable]``
builds a small GPTModel in Llama form (RMSNorm, SwiGLU, rotary, 8 query heads in 4 groups,
untied head; Megatron's local layer spec), fills it from a seed, and saves it in Megatron-LM's
layout: ``OUT/latest_checkpointed_iteration.txt`` and ``OUT/iter_0000001/`` holding ``{"model":
..., "args": Namespace, "iteration": 1, ...}`` and, with ``--optimizer``, the
DistributedOptimizer's state after one Adam step at learning rate 0 (moments set, weights
unchanged) in that sharding form. ``OUT/megatron_logits.pt`` holds Megatron's own forward
logits for fixed tokens. One process, gloo, tp = pp = 1.

CPU stand-ins, all outside what is saved: ``torch.cuda.synchronize``/``current_device``
(called around the save), the CUDA RNG tracker's ``fork`` (dropout is 0), and for the
optimizer a torch-function mode that puts Megatron's ``device="cuda"`` buffers on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import warnings

import torch
import torch.nn.functional as F

SIZES = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=8,
             num_query_groups=4, vocab_size=256, max_sequence_length=64)
TOKENS = torch.arange(2 * 16).reshape(2, 16) * 37 % 256  # fixed ids for the logits


class CudaToCpu(torch.overrides.TorchFunctionMode):
    """Megatron's DDP and optimizer allocate on ``device="cuda"`` and check
    ``Tensor.type() == "torch.cuda.FloatTensor"``: allocate on the CPU and answer as CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            cuda = name.replace("torch.", "torch.cuda.", 1)
            return name if name.startswith("torch.cuda.") else cuda
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and str(args[1]).startswith("cuda"):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def start() -> None:
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    parallel_state.initialize_model_parallel(1, 1)
    mrandom.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def model(seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = SIZES
    config = TransformerConfig(
        num_layers=s["num_layers"], hidden_size=s["hidden_size"],
        ffn_hidden_size=s["ffn_hidden_size"], num_attention_heads=s["num_attention_heads"],
        num_query_groups=s["num_query_groups"], normalization="RMSNorm", layernorm_epsilon=1e-5,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(
        normalization="RMSNorm"), vocab_size=s["vocab_size"],
        max_sequence_length=s["max_sequence_length"], share_embeddings_and_output_weights=False,
        position_embedding_type="rope", rotary_base=10000)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(gpt.named_parameters()):
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * r if name.endswith("layernorm.weight") else 0.05 * r)
    return gpt.eval()


def logits(gpt) -> torch.Tensor:
    b, s = TOKENS.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s)
    with torch.no_grad():
        return gpt(input_ids=TOKENS, position_ids=torch.arange(s).expand(b, s),
                   attention_mask=mask)


def optimizer_state(gpt, sharding: str, model_sd: dict) -> dict:
    """One Adam step of Megatron's DistributedOptimizer at lr 0; its sharded state dict."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    CudaToCpu().__enter__()
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True), module=gpt)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=0.0, min_lr=0.0, weight_decay=0.0, use_distributed_optimizer=True,
        params_dtype=torch.float32), [ddp])
    b, s = TOKENS.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).view(1, 1, s, s)
    ddp.zero_grad_buffer()
    loss = ddp(input_ids=TOKENS, position_ids=torch.arange(s).expand(b, s),
               attention_mask=mask, labels=torch.roll(TOKENS, -1, 1))
    loss.mean().backward()
    ddp.finish_grad_sync()
    assert opt.step()[0]
    return opt.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": sharding})


def megatron_lm_args() -> argparse.Namespace:
    """The ``args`` Megatron-LM saves: its parsed command line, which holds Megatron's own
    enums (``--attention-backend``'s default) and torch dtypes beside plain values."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(rotary_interleaved=False, num_layers=2, ckpt_format="torch_dist",
                              iteration=1, attention_backend=AttnBackend.auto,
                              params_dtype=torch.float32, make_vocab_size_divisible_by=128,
                              tensor_model_parallel_size=1, vocab_size=SIZES["vocab_size"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--optimizer", choices=["fully_reshardable", "dp_reshardable"])
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    start()
    gpt = model(args.seed)
    torch.save({"tokens": TOKENS, "logits": logits(gpt)},
               os.path.join(args.out, "megatron_logits.pt"))
    from megatron.core import dist_checkpointing

    state = {"model": gpt.sharded_state_dict()}
    if args.optimizer:
        state["optimizer"] = optimizer_state(gpt, args.optimizer, state["model"])
    state.update(args=megatron_lm_args(), checkpoint_version=3.0, iteration=1)
    ckpt = os.path.join(args.out, "iter_0000001")
    os.makedirs(ckpt)
    dist_checkpointing.save(state, ckpt)
    with open(os.path.join(args.out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("1")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
