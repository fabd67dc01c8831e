"""Peak resident memory of every conversion (``hpctrain import`` and ``hpctrain export`` in
each format, with and without the optimizer's moments) against the bound ``largest tensor x
2 + 500 MiB`` (docs/interchange.md).

A checkpoint with Llama-3-8B's widths (vocabulary 128,256, width 4,096, 32 query and 8
key/value heads, ffn 14,336; one layer, the head tied to the embedding, so that about 34 GB
are written in all and 17 GB lie on disk at most) is generated, float32 with random moments
at step 1, then converted from format to format, each conversion the real CLI in a fresh
process whose own peak (VmHWM) is read (:func:`measure`; ``ru_maxrss`` of a child starts at
its parent's). The largest tensor is the largest either side of a conversion holds: the
embedding as hpctrain stores it, float32, 2004 MiB. Foreign files are bfloat16 where the
format allows (the HF and DCP exports). The safetensors and DCP exports skip the checksum
pass (``--no-verify``: it reads 16 MiB blocks; the HF export keeps it); the Hugging Face and
safetensors exports never read the moments, and a Hugging Face import writes zero moments.
Each file is removed once no later conversion reads it. ``--size tiny``: the same chain on
a vocabulary of 8,192 and width 512, in two minutes. Memory does not vary with repeats: each
conversion runs once.

``run(world, size, repeats)`` follows the :mod:`benchmarks` protocol (one rank).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from . import common
from .common import result, row

RANKS = (1,)
SHAPES = {"small": dict(vocab_size=128256, d_model=4096, n_heads=32, n_kv_heads=8,
                        d_ff=14336, n_layers=1, tie_embeddings="true"),  # Llama-3-8B's widths
          "tiny": dict(vocab_size=8192, d_model=512, n_heads=8, n_kv_heads=4, d_ff=1536,
                       n_layers=1, tie_embeddings="true")}
ALLOWANCE_MIB = 500
MIB = 2**20
# what every conversion loads, imported before the baseline is read
MEASURE = """
import h5py, numpy, safetensors, torch
import torch.distributed.checkpoint
from hpctrain.__main__ import main
from hpctrain.cli import export
from hpctrain.interchange import hf_export, hf_import, trainers
print("BASE", [int(x.split()[1]) for x in open("/proc/self/status") if x.startswith("VmRSS")][0])
rc = main(sys.argv[1:])
"""


def measure(args: list) -> dict:
    """``hpctrain ARGS`` in a fresh process: its peak resident memory (VmHWM), the resident
    memory after the modules every conversion uses were imported (``base``), both MiB, and
    its seconds. A conversion that fails raises, with its output."""
    t0 = time.perf_counter()
    proc, peak = common.in_fresh_process(MEASURE, [str(a) for a in args])
    base = [int(x.split()[1]) for x in proc.stdout.splitlines() if x.startswith("BASE")][-1]
    return {"peak_mib": peak, "base_mib": base / 1024, "seconds": time.perf_counter() - t0}


def model_config(**shapes):
    """The Config of the generated checkpoint: a float32 llama of ``shapes``."""
    from hpctrain.config import load

    return load(None, ['model.arch="llama"', 'model.dtype="float32"',
                       *[f"model.{k}={v}" for k, v in shapes.items()]])


def generate(path: Path, cfg, seed: int = 0) -> int:
    """Write a checkpoint of ``cfg``'s model at ``path``: random parameters and moments at
    step 1, one tensor in memory at a time; returns its largest tensor's bytes."""
    from hpctrain.interchange.hf_import import write_checkpoint
    from hpctrain.interchange.trainers import model_shapes

    shapes = model_shapes(cfg.model)
    rng = np.random.default_rng(seed)

    def random(shape, scale):
        a = rng.random(shape, dtype=np.float32)
        a -= 0.5
        a *= scale
        return a

    def pairs():
        for name, shape in shapes.items():
            yield f"model/{name}", random(shape, 0.04)
            yield f"optim/{name}/exp_avg", random(shape, 1e-3)
            yield f"optim/{name}/exp_avg_sq", np.abs(random(shape, 1e-6))

    write_checkpoint(path, cfg, pairs(), {}, 1, 1)
    return max(int(np.prod(s)) for s in shapes.values()) * 4


def steps(d: Path, config: Path) -> list:
    """The chain of conversions: (name, moments, hpctrain arguments, files to remove
    after it). Each reads what an earlier one wrote; ``a.h5`` is marked without moments
    (:func:`without_moments`) before the second DCP export."""
    ckpt, hf, dcp_m, dcp_0 = d / "a.h5", d / "hf", d / "dcp_m", d / "dcp_0"
    export = ("export", ckpt, "--no-verify", "--format")
    imp = ("import", "--format", "dcp")
    bf16 = ("--dtype", "bfloat16")
    return [
        ("export --format safetensors", "not read",
         (*export, "safetensors", "--out", d / "a.safetensors"), [d / "a.safetensors"]),
        ("export --format hf", "not read", ("export", ckpt, "--format", "hf", *bf16, "--out",
                                             hf), []),
        ("export --format dcp", "with", (*export, "dcp", *bf16, "--out", dcp_m), []),
        ("export --format dcp", "without", (*export, "dcp", *bf16, "--out", dcp_0), [ckpt]),
        ("import --format dcp", "with", (*imp, dcp_m, "--config", config, "--out", d / "b.h5"),
         [dcp_m, d / "b.h5"]),
        ("import (hf)", "zero", ("import", hf, "--out", d / "c.h5"), [hf, d / "c.h5"]),
        ("import --format dcp", "without", (*imp, dcp_0, "--config", config, "--out",
                                            d / "e.h5"), [dcp_0, d / "e.h5"]),
    ]


def without_moments(path: Path) -> None:
    """Mark checkpoint ``path`` as one whose optimizer never stepped (``optim_step`` 0, as a
    fresh import is), so that the DCP export leaves the moments out. The datasets' checksums
    are unchanged."""
    import h5py

    with h5py.File(path, "r+") as f:
        f.attrs["optim_step"] = 0


def chain(d: Path, size: str) -> tuple[list[dict], int]:
    """Generate the checkpoint in ``d`` and run :func:`steps`; (a row per conversion,
    the largest tensor's bytes)."""
    from hpctrain.config import dumps_toml

    cfg = model_config(**SHAPES[size])
    config = d / "model.toml"
    config.write_text(dumps_toml(cfg))
    t0 = time.perf_counter()
    largest = generate(d / "a.h5", cfg)
    rows = [{"conversion": "generate (in the benchmark)", "moments": "with",
             "seconds": time.perf_counter() - t0}]
    for name, moments, args, done in steps(d, config):
        if name == "export --format dcp" and moments == "without":
            without_moments(d / "a.h5")
        rows.append({"conversion": name, "moments": moments, **measure(args)})
        for path in done:
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return rows, largest


def run(world, size: str, repeats: int) -> dict:
    res = result("interchange", world, size, repeats,
                 "peak resident memory of each import and export against largest tensor x 2 + "
                 f"{ALLOWANCE_MIB} MiB ({SHAPES[size]})")
    d = Path(tempfile.mkdtemp(prefix="hpctrain-bench-interchange-"))
    try:
        rows, largest = chain(d, size)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    big = largest / MIB
    for r in rows[1:]:
        r.update(largest_mib=big, peak_over_largest=r["peak_mib"] / big,
                 over_twice_mib=r["peak_mib"] - 2 * big)
        what = f"{r['conversion']}, moments {r['moments']}"
        res["rows"].append(row(f"{what}: peak", [r["peak_mib"]], "MiB"))
        res["ratios"].append(common.ratio(f"{what}: peak - 2 x largest, MiB",
                                          r["over_twice_mib"], f"<= {ALLOWANCE_MIB}"))
    res["table"] = rows
    res["notes"].append(f"largest tensor {big:.0f} MiB (float32); peak: VmHWM of a fresh "
                        f"process running the CLI; the generated checkpoint took "
                        f"{rows[0]['seconds']:.0f} s")
    return res


def markdown(res: dict) -> list[str]:
    """The table of docs/results.md: one row per conversion."""
    out = ["| conversion | moments | peak (MiB) | peak / largest | peak - 2 x largest (MiB) | "
           f"<= {ALLOWANCE_MIB} | base (MiB) | s |", "|---|---|---|---|---|---|---|---|"]
    for r in res["table"][1:]:
        out.append(f"| {r['conversion']} | {r['moments']} | {r['peak_mib']:.0f} | "
                   f"{r['peak_over_largest']:.2f} | {r['over_twice_mib']:.0f} | "
                   f"{'yes' if r['over_twice_mib'] <= ALLOWANCE_MIB else '**no**'} | "
                   f"{r['base_mib']:.0f} | {r['seconds']:.0f} |")
    return out
