"""Checkpoints as torchtitan writes them, for tests/e2e/test_dcp_interchange.py: a random
``LlamaForCausalLM`` after one AdamW step, its state in torchtitan's Llama 3 names (the model
flattened at the top level, ``wq``/``wk`` rows in Meta's interleaved rotary order, the
optimizer flattened by name as ``optimizer.state.<name>.<exp_avg|exp_avg_sq|step>`` and
``optimizer.param_groups.<name>.<key>``, ``train_state.step``, an ``lr_scheduler`` entry),
saved by torch's DCP writer. With ``ranks = 2`` two gloo processes save it as FSDP2 holds it:
every tensor a DTensor sharded on dim 0, so the checkpoint is two ``.distcp`` files of chunks.

The permutation here is torchtitan's adapter's ``_reverse_permute`` written out in torch, not
hpctrain's own function, so a wrong order in hpctrain cannot cancel itself.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import transformers

LAYER = {"self_attn.q_proj": "{qkv}wq", "self_attn.k_proj": "{qkv}wk", "self_attn.v_proj":
         "{qkv}wv", "self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1",
         "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2",
         "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}


def titan_key(hf_key: str, qkv: str, head: str) -> str:
    if hf_key == "lm_head.weight":
        return head
    if hf_key == "model.embed_tokens.weight":
        return "tok_embeddings.weight"
    if hf_key == "model.norm.weight":
        return "norm.weight"
    parts = hf_key.split(".")  # model.layers.N.<module>.<sub>.weight
    return f"layers.{parts[2]}." + LAYER[".".join(parts[3:-1])].format(qkv=qkv) + ".weight"


def interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """torchtitan's ``_reverse_permute``: Hugging Face rows to Meta's interleaved order."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def trained(sizes: dict, seed: int):
    """(model, optimizer) after one AdamW step on a random batch."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    x = torch.randint(0, sizes["vocab_size"], (2, 16))
    model(x, labels=x).loss.backward()
    opt.step()
    return model, opt


def titan_state(model, opt, sizes: dict, qkv: str, head: str, moments: bool) -> dict:
    """torchtitan's flattened state dict of ``model`` and ``opt`` (plain tensors)."""
    heads = {"self_attn.q_proj": sizes["num_attention_heads"],
             "self_attn.k_proj": sizes["num_key_value_heads"]}
    out: dict = {}
    for name, p in model.named_parameters():
        key = titan_key(name, qkv, head)
        n = next((h for part, h in heads.items() if part in name), None)
        conv = (lambda t, n=n: interleaved(t.detach(), n).contiguous()) if n else \
            (lambda t: t.detach().clone())
        out[key] = conv(p)
        if moments:
            st = opt.state[p]
            out.update({f"optimizer.state.{key}.exp_avg": conv(st["exp_avg"]),
                        f"optimizer.state.{key}.exp_avg_sq": conv(st["exp_avg_sq"]),
                        f"optimizer.state.{key}.step": st["step"].clone()})
            out.update({f"optimizer.param_groups.{key}.{k}": v
                        for k, v in opt.param_groups[0].items() if k != "params"})
    if moments:
        out.update({"train_state.step": 1, "lr_scheduler.last_epoch": 1})
    return out


def write(out: Path, sizes: dict, seed: int = 0, ranks: int = 1, qkv: str = "attention.",
          head: str = "output.weight", moments: bool = True, hf: Path | None = None):
    """Save the checkpoint to ``out`` (and the same model as a Hugging Face directory to
    ``hf``); returns (model, optimizer) as they were saved."""
    model, opt = trained(sizes, seed)
    if hf is not None:
        model.save_pretrained(hf)
    state = titan_state(model, opt, sizes, qkv, head, moments)
    if ranks == 1:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out)), no_dist=True)
    else:
        torch.save(state, out.with_suffix(".plain.pt"))
        torch.multiprocessing.spawn(_sharded_save, (out, ranks, _free_port()), nprocs=ranks)
        out.with_suffix(".plain.pt").unlink()
    return model, opt


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_save(rank: int, out: Path, ranks: int, port: int) -> None:
    """One FSDP2-like rank: every tensor of 1+ dims a DTensor sharded on dim 0."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    mesh = init_device_mesh("cpu", (ranks,))
    plain = torch.load(out.with_suffix(".plain.pt"), weights_only=True)
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) if torch.is_tensor(v) and v.dim()
             else v for k, v in plain.items()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(out)))
    dist.destroy_process_group()
