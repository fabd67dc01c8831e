"""MFU of hpctrain's training step on one GPU vs a plain PyTorch loop on the same model.

The model is hpctrain's GPT (``DecoderStage``: RMSNorm, GELU MLP of 4 x d_model, no positional
encoding, untied head): GPT-form, not llama-form (no RoPE, SwiGLU or grouped-query attention).
The size comes from the arguments; the GPU check uses ~1.3B parameters (24 layers, d_model
2048, 16 heads, seq 2048, vocab 32000, bf16), the dry run a tiny one on CPU.

* **plain PyTorch**: the same ``DecoderStage`` in bf16, one forward of the whole batch,
  ``backward``, ``clip_grad_norm_(1.0)``, ``torch.optim.AdamW`` (fused on CUDA) on the bf16
  parameters (no float32 master weights: less work than hpctrain's step, so a lower bound on
  what a plain loop costs); timed over ``--steps`` steps after ``--warmup``, one sync at the
  end.
* **hpctrain**: ``hpctrain.train.train`` itself (what ``hpctrain train`` runs: data sampler,
  schedule runner, bucketed gradients in float32, global norm, clip, AdamW with float32
  masters, numeric guard, telemetry) on one rank, one microbatch of the whole batch per step;
  its own ``step_time_s`` per step from ``metrics.jsonl``, mean over the steps after
  ``--warmup``.

Model FLOPs: ``hpctrain.planner.flops.train_flops_per_token`` (6 per parameter-token in the
matmuls plus causal attention, 3 x forward). MFU against the H200's dense bf16 peak
(``--peak``, 989 TFLOP/s from the spec sheet) and against a bf16 8192^3 matmul measured here.
Run under ``mpirun -n 1 python -m mpi4py tests/gpu/mfu.py ...``; everything printed after the
``@@MFU@@`` line is the result.
"""

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from hpctrain.config import load
from hpctrain.model import DecoderStage, init_parameters
from hpctrain.planner.flops import train_flops_per_token
from hpctrain.train import train

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
ap.add_argument("--layers", type=int, default=24)
ap.add_argument("--d-model", type=int, default=2048)
ap.add_argument("--heads", type=int, default=16)
ap.add_argument("--seq", type=int, default=2048)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--vocab", type=int, default=32000)
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--warmup", type=int, default=3)
ap.add_argument("--peak", type=float, default=989e12, help="spec dense peak FLOP/s")
ap.add_argument("--run-dir", default="/tmp/hpctrain-mfu")
a = ap.parse_args()

dev = torch.device(a.device)
cuda = a.device == "cuda"
sync = torch.cuda.synchronize if cuda else (lambda: None)
B, T = a.batch, a.seq
cfg = load(None, [
    f"model.n_layers={a.layers}", f"model.d_model={a.d_model}", f"model.n_heads={a.heads}",
    f"model.vocab_size={a.vocab}", f'model.dtype="{a.dtype}"', f'model.device="{a.device}"',
    f"train.seq_len={T}", f"train.global_batch_size={B}", f"train.micro_batch_size={B}",
    f"train.steps={a.warmup + a.steps}", "train.log_every=1", "checkpoint.save_final=false",
    "optim.warmup_steps=2",
])
flops_step = train_flops_per_token(cfg.model, T) * B * T


def measured_peak() -> float:
    """bf16 8192^3 matmul on this GPU: mean of 10 after 3 warm-ups (as the device notes)."""
    n = 8192
    x = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    y = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        x @ y
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        x @ y
    sync()
    return 2 * n**3 * 10 / (time.perf_counter() - t0)


def plain_loop() -> tuple[float, int]:
    torch.manual_seed(0)
    model = DecoderStage(cfg.model, range(cfg.model.n_layers), True, True)
    init_parameters([model], cfg.train.seed)
    model = model.to(dev)
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1,
                            fused=True if cuda else None)
    x = torch.randint(0, a.vocab, (B, T), device=dev)
    y = torch.randint(0, a.vocab, (B, T), device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        (model(x, y) / (B * T)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for _ in range(a.warmup):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    return (time.perf_counter() - t0) / a.steps, n  # the model and its state go with us


peak_measured = measured_peak() if cuda else float("nan")
t_plain, n_params = plain_loop()
gc.collect()
if cuda:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
train(cfg, a.run_dir)
metrics = [json.loads(x) for x in (Path(a.run_dir) / "metrics.jsonl").read_text().splitlines()]
times = [m["step_time_s"] for m in metrics if m["step"] > a.warmup]
t_ours = sum(times) / len(times)
mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")

print("@@MFU@@")
print(f"GPT-form model, {n_params / 1e6:,.1f}M parameters: {a.layers} layers, d_model "
      f"{a.d_model}, {a.heads} heads, seq {T}, vocab {a.vocab}, {a.dtype}, batch {B} x {T} "
      f"tokens per step, on {a.device}; model FLOPs {flops_step / 1e12:.4g} TFLOP per step; "
      f"{a.warmup} warm-up + {a.steps} timed steps each")
if cuda:
    print(f"bf16 8192^3 matmul measured here: {peak_measured / 1e12:.0f} TFLOP/s; spec peak "
          f"{a.peak / 1e12:.0f} TFLOP/s; hpctrain's peak GPU memory allocated {mem:.1f} GiB\n")
    print("| loop | s/step | tokens/s | model TFLOP/s | MFU vs spec | MFU vs measured matmul |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, t in (("plain PyTorch", t_plain), ("hpctrain (train.train)", t_ours)):
        print(f"| {name} | {t:.4f} | {B * T / t:,.0f} | {flops_step / t / 1e12:.1f} | "
              f"{flops_step / t / a.peak:.1%} | {flops_step / t / peak_measured:.1%} |")
else:
    print("note: dry run on CPU: the timings below prove the script, they are not GPU "
          "figures, and no MFU is claimed\n")
    print("| loop | s/step (CPU) |\n|---|---:|")
    for name, t in (("plain PyTorch", t_plain), ("hpctrain (train.train)", t_ours)):
        print(f"| {name} | {t:.4f} |")
print(f"\nhpctrain / plain step time: {t_ours / t_plain:.3f}")
