"""MFU of one training step of a ~100M-parameter GPT on one GPU: hpctrain's train step
(GPTStage + GradBuffers + AdamW, bf16 with fp32 master weights) vs a plain PyTorch loop on
the same model (torch.optim.AdamW, fused where available). MFU = 6 * N * tokens/s / peak."""

import os
import time
from dataclasses import replace

import torch

from hpctrain.config import load
from hpctrain.model import GPTStage, init_parameters

PEAK = float(os.environ.get("PEAK_FLOPS", 989e12))  # H100/H200 dense bf16
cfg = replace(load(None).model, n_layers=12, d_model=768, n_heads=12, vocab_size=256,
              dtype="bfloat16")
B, T, steps = 8, 1024, 10
dev = torch.device("cuda")


def build():
    m = GPTStage(cfg, range(cfg.n_layers), True, True)
    init_parameters([m], 1)
    return m.to(dev)


def timed(step):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


x = torch.randint(0, 256, (B, T), device=dev)
model = build()
n = sum(p.numel() for p in model.parameters())
flops = 6 * n * B * T + 12 * cfg.n_layers * cfg.d_model * T * B * T  # + attention

# plain PyTorch
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)


def plain():
    opt.zero_grad(set_to_none=True)
    (model(x, x) / (B * T)).backward()
    opt.step()


t_plain = timed(plain)

# hpctrain's pieces, one rank
from hpctrain import comm  # noqa: E402
from hpctrain.config import TopologyConfig  # noqa: E402
from hpctrain.optim.adamw import AdamW, clip_, global_grad_norm  # noqa: E402
from hpctrain.parallel.data import GradBuffers  # noqa: E402
from hpctrain.topology import Topology  # noqa: E402

topo = Topology(TopologyConfig(), comm.world())
model = build()
params = list(model.named_parameters())
grads = GradBuffers(params, topo, 25.0)
hp_opt = AdamW(params, load(None).optim)


def ours():
    grads.zero()
    (model(x, x) / (B * T)).backward()
    grads.reduce()
    norm = global_grad_norm(params, topo)
    clip_(params, 1.0, norm)
    hp_opt.step(1e-4)


t_ours = timed(ours)
print(f"\nmodel {n / 1e6:.1f}M parameters, batch {B}x{T} tokens, bf16\n")
print("| loop | s/step | tokens/s | MFU |\n|---|---:|---:|---:|")
for name, t in (("plain PyTorch", t_plain), ("hpctrain", t_ours)):
    print(f"| {name} | {t:.4f} | {B * T / t:,.0f} | {flops / t / PEAK:.1%} |")
print(f"\nhpctrain / plain step time: {t_ours / t_plain:.3f}")
