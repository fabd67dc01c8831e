"""Published training runs, fed to the cost model with their published hardware and layout.

Each :class:`Run` holds the model shape, layout and batch its authors state, the cluster
description of their hardware (``share/clusters``), the published per-GPU throughput in
tokens/s and where it comes from. :func:`table` predicts every run and gives the relative
error; ``tests/unit/test_perf.py`` holds the tolerance (20 %) for the runs marked ``held``
and ``hpctrain plan --published`` prints the table (docs/planning.md sums it up).

Sources:

- **Narayanan et al. 2021**, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM" (SC21, arXiv:2104.04473), Table 1: GPT, vocabulary 51,200, sequence
  2048, mixed precision, full activation recomputation, on Selene (DGX A100). The table gives
  achieved teraFLOP/s per GPU under the paper's count ``96 B s l h^2 (1 + s/6h + V/16lh)``
  per batch (recomputation and the masked half of attention included); tokens/s per GPU =
  that / (the count per token). Microbatch size 1 and the 1F1B schedule are our assumption
  (Table 1 does not state them).
- **torchtitan** ``docs/performance.md``: at commit 0413364434916bdc0f88c1f89fda176fd3c2092e4
  Llama 3 / Llama 2 with FSDP2 on 64 A100 80GB (WPS = tokens/s per GPU, local batch 1 or 2,
  sequence 8192 / 4096); at commit eaea6f6a2fa940f03a10906be1df3489cf30af85 Llama 3.1 8B with
  FSDP on 8 and 128 H100 (500 W, HBM2e; Table 1 and 3, eager, no Float8). FSDP is ZeRO-3,
  which hpctrain does not have: the cost model's ``fsdp`` mode (planned) stands in.
- **Dash et al. 2023**, "Optimizing Distributed Training on Frontier for Large Language
  Models" (arXiv:2312.12705): GPT 22B, 175B and 1T on Frontier's MI250X GCDs at 38.38 %,
  36.14 % and 31.96 % of the GCD's 191.5 TFLOP/s (73.5, 69.2, 61.2 TFLOP/s). The layouts are
  the authors' job scripts (github.com/sajal-vt/Megatron-DeepSpeed-ORNL, branch FA2 at commit
  03325d437c96a8751ed72e44bb0938c8b46608cb: ``launch_gpt22b_bf16.slurm``,
  ``launch_gpt175b_bf16.slurm``, ``launch_gpt1T_bf16.slurm``; the paper's own table could not
  be consulted): Megatron-DeepSpeed, full activation checkpointing, FlashAttention-2, GPT-2
  vocabulary padded to 128 x tp. Throughput under Megatron-DeepSpeed's count, the same
  ``96 B s l h^2 (1 + s/6h + V/16lh)`` as Narayanan et al.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..config import from_dict
from .cluster import load
from .cost import Extras, predict

NARAYANAN = "Narayanan et al. 2021 (arXiv:2104.04473), Table 1"
TITAN_A100 = "torchtitan docs/performance.md @0413364 (64 A100, FSDP2)"
TITAN_H100 = "torchtitan docs/performance.md @eaea6f6 (H100 500 W, FSDP)"
DASH = "Dash et al. 2023 (arXiv:2312.12705); layouts: sajal-vt/Megatron-DeepSpeed-ORNL @03325d4"


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    cluster: str
    model: dict  # ModelConfig keys
    layout: dict  # dp, tp, pp
    train: dict  # global_batch_size, micro_batch_size, seq_len
    extras: Extras
    tokens_per_s_per_gpu: float  # published (or derived from published TFLOP/s)
    published: str  # the figure as the source prints it
    held: bool = True  # inside the test's tolerance; False: shown with the reason
    note: str = ""
    optim: dict = field(default_factory=dict)  # OptimConfig keys the source states (zero)


def _megatron(params, heads, h, layers, tp, pp, gpus, batch, tflops, pct) -> Run:
    s, V = 2048, 51200
    per_token = 96 * layers * h * h * (1 + s / (6 * h) + V / (16 * layers * h))
    return Run(
        f"GPT {params}B", NARAYANAN, "dgx-a100",
        {"n_layers": layers, "d_model": h, "n_heads": heads, "vocab_size": V,
         "dtype": "bfloat16", "recompute": True},
        {"dp": gpus // (tp * pp), "tp": tp, "pp": pp},
        {"global_batch_size": batch, "micro_batch_size": 1, "seq_len": s},
        Extras(attention_full=True), tflops * 1e12 / per_token,
        f"{tflops} TFLOP/s/GPU ({pct}% of peak), {gpus} GPUs, TP={tp} PP={pp}")


def _llama(name, source, cluster, shape, gpus, local, seq, full_ac, wps, published,
           held=True, note="") -> Run:
    L, C, H, kv, F, V = shape
    return Run(
        name, source, cluster,
        {"n_layers": L, "d_model": C, "n_heads": H, "d_ff": F, "vocab_size": V,
         "dtype": "bfloat16", "recompute": full_ac},
        {"dp": gpus, "tp": 1, "pp": 1},
        {"global_batch_size": gpus * local, "micro_batch_size": local, "seq_len": seq},
        Extras(n_kv_heads=kv, gated_mlp=True, fsdp=True), wps, published, held, note)


def _frontier(params, shape, tp, pp, gpus, batch, seq, dtype, zero, tflops, pct) -> Run:
    """A GPT run of Dash et al. on Frontier: one rank per MI250X GCD, recompute on."""
    layers, h, heads = shape
    V = -(-50257 // (128 * tp)) * 128 * tp  # GPT-2 vocabulary padded as Megatron pads it
    per_token = 96 * layers * h * h * (1 + seq / (6 * h) + V / (16 * layers * h))
    return Run(
        f"GPT {params}", DASH, "frontier-mi250x",
        {"n_layers": layers, "d_model": h, "n_heads": heads, "vocab_size": V,
         "dtype": dtype, "recompute": True},
        {"dp": gpus // (tp * pp), "tp": tp, "pp": pp},
        {"global_batch_size": batch, "micro_batch_size": 1, "seq_len": seq},
        Extras(), tflops * 1e12 / per_token,
        f"{tflops} TFLOP/s/GCD ({pct}% of peak), {gpus} GCDs, TP={tp} PP={pp}",
        optim={"zero": zero})


LLAMA3_8B = (32, 4096, 32, 8, 14336, 128256)
LLAMA3_70B = (80, 8192, 64, 8, 28672, 128256)
LLAMA2_13B = (40, 5120, 40, 40, 13824, 32000)
LLAMA2_70B = (80, 8192, 64, 8, 28672, 32000)
H100_NOTE = ("500 W power limit and HBM2e: torchtitan reports 33-39% MFU against the SXM "
             "peak, below what the one efficiency constant assumes")

RUNS = [
    _megatron(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    _megatron(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    _megatron(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    _megatron(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    _megatron(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    _megatron(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    _megatron(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    _megatron(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    _megatron(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    _megatron(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
    _llama("Llama 3 8B", TITAN_A100, "dgx-a100", LLAMA3_8B, 64, 1, 8192, False, 2973,
           "2973 WPS, 58.2% MFU (selective op AC)"),
    _llama("Llama 3 70B", TITAN_A100, "dgx-a100", LLAMA3_70B, 64, 1, 8192, True, 331,
           "331 WPS, 51.7% MFU (full AC)"),
    _llama("Llama 2 13B", TITAN_A100, "dgx-a100", LLAMA2_13B, 64, 2, 4096, False, 2162,
           "2162 WPS, 61.1% MFU (no AC)"),
    _llama("Llama 2 70B", TITAN_A100, "dgx-a100", LLAMA2_70B, 64, 2, 4096, True, 353,
           "353 WPS, 50.5% MFU (full AC)"),
    _llama("Llama 3.1 8B", TITAN_H100, "grand-teton-h100", LLAMA3_8B, 8, 2, 8192, False, 5762,
           "5,762 TPS/GPU, 8 GPUs (Table 1, FSDP)", False, H100_NOTE),
    _llama("Llama 3.1 8B", TITAN_H100, "grand-teton-h100", LLAMA3_8B, 128, 2, 8192, False,
           5605, "5,605 TPS/GPU, 128 GPUs (Table 3, FSDP)", False, H100_NOTE),
    _frontier("22B", (48, 6144, 48), 1, 8, 16, 640, 2048, "float16", 0, 73.5, 38.38),
    _frontier("175B", (96, 12288, 96), 4, 16, 128, 640, 4096, "float16", 1, 69.2, 36.14),
    _frontier("1T", (128, 25600, 200), 4, 128, 1024, 1024, 2048, "bfloat16", 1, 61.2, 31.96),
]


def config_of(run: Run):
    return from_dict({"model": run.model, "topology": run.layout, "train": run.train,
                      "optim": run.optim, "checkpoint": {"save_final": False}})


def table(runs=RUNS) -> list[dict]:
    """Per run: published and predicted tokens/s per GPU, relative error, predicted MFU."""
    out = []
    for run in runs:
        p = predict(config_of(run), load(run.cluster), run.extras)
        got = p.tokens_per_s_per_rank
        out.append({"run": run, "predicted": got, "mfu": p.mfu, "step_s": p.step_s,
                    "error": got / run.tokens_per_s_per_gpu - 1, "prediction": p})
    return out


def fitted_efficiency(runs, rounds: int = 3) -> float:
    """The one ``efficiency`` for the runs' cluster that leaves their mean log error at 0
    (how a cluster's constant is fitted once): the rate scales with it where compute
    dominates, so a few multiplicative rounds converge."""
    cluster = load(runs[0].cluster)
    eff = cluster.efficiency
    for _ in range(rounds):
        c = dataclasses.replace(cluster, efficiency=eff)
        logs = [math.log(predict(config_of(r), c, r.extras).tokens_per_s_per_rank
                         / r.tokens_per_s_per_gpu) for r in runs]
        eff *= math.exp(-sum(logs) / len(logs))
    return eff


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def markdown(rows) -> str:
    lines = ["| model | layout (GPUs) | published | tokens/s/GPU published | predicted | "
             "error | predicted MFU | held | source |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run, t = r["run"], r["run"].layout
        layout = f"dp={t['dp']} tp={t['tp']} pp={t['pp']}" + (
            " (FSDP)" if run.extras.fsdp else "")
        lines.append(f"| {run.name} | {layout} ({t['dp'] * t['tp'] * t['pp']}) | "
                     f"{run.published} | {_rate(run.tokens_per_s_per_gpu)} | "
                     f"{_rate(r['predicted'])} | {100 * r['error']:+.1f}% | "
                     f"{100 * r['mfu']:.1f}% | {'yes' if run.held else 'no: ' + run.note} | "
                     f"{run.source} |")
    return "\n".join(lines)
