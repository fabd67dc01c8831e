"""Published training runs, fed to the cost model with their published hardware and layout.

Each :class:`Run` holds the model shape, layout and batch its authors state, the cluster
description of their hardware (``share/clusters``), the published per-GPU throughput in
tokens/s and where it comes from. :func:`table` predicts every run and gives the relative
error; ``tests/unit/test_perf.py`` holds the tolerance (20 %) for the runs marked ``held``
and docs/performance-model.md prints the table (``hpctrain plan --published``).

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
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import from_dict
from .cluster import load
from .cost import Extras, predict

NARAYANAN = "Narayanan et al. 2021 (arXiv:2104.04473), Table 1"
TITAN_A100 = "torchtitan docs/performance.md @0413364 (64 A100, FSDP2)"
TITAN_H100 = "torchtitan docs/performance.md @eaea6f6 (H100 500 W, FSDP)"


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
]


def config_of(run: Run):
    return from_dict({"model": run.model, "topology": run.layout, "train": run.train,
                      "checkpoint": {"save_final": False}})


def table(runs=RUNS) -> list[dict]:
    """Per run: published and predicted tokens/s per GPU, relative error, predicted MFU."""
    out = []
    for run in runs:
        p = predict(config_of(run), load(run.cluster), run.extras)
        got = p.tokens_per_s_per_rank
        out.append({"run": run, "predicted": got, "mfu": p.mfu, "step_s": p.step_s,
                    "error": got / run.tokens_per_s_per_gpu - 1, "prediction": p})
    return out


def markdown(rows) -> str:
    lines = ["| model | layout (GPUs) | published | tokens/s/GPU published | predicted | "
             "error | predicted MFU | held | source |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        run, t = r["run"], r["run"].layout
        layout = f"dp={t['dp']} tp={t['tp']} pp={t['pp']}" + (
            " (FSDP)" if run.extras.fsdp else "")
        lines.append(f"| {run.name} | {layout} ({t['dp'] * t['tp'] * t['pp']}) | "
                     f"{run.published} | {run.tokens_per_s_per_gpu:,.0f} | "
                     f"{r['predicted']:,.0f} | {100 * r['error']:+.1f}% | "
                     f"{100 * r['mfu']:.1f}% | {'yes' if run.held else 'no: ' + run.note} | "
                     f"{run.source} |")
    return "\n".join(lines)
