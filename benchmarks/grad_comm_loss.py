"""The loss with 16-bit gradient traffic against float32 traffic, over a few hundred steps
of the demo (``share/configs/demo.toml``, dp=4):

    python -m benchmarks.grad_comm_loss [--steps 300] [--out FILE] [--set KEY=VALUE ...]

trains the demo twice under ``mpirun`` (``optim.grad_comm_dtype`` = ``""`` and
``"bfloat16"``, nothing else differs) and prints, per step window, the relative difference of
the training losses, the held-out losses at every evaluation, and the dp bytes per step
(what docs/results.md, "16-bit gradient traffic", shows). Not a part of ``make bench``
(minutes of training); from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from hpctrain.job.launch import ROOT, command, launch_env, with_checkout

DEMO = ROOT / "share" / "configs" / "demo.toml"
SIDES = {"float32": '""', "bfloat16": '"bfloat16"'}


def train(run_dir: Path, steps: int, wire: str, extra: list[str]) -> list[dict]:
    sets = [*extra, f"train.steps={steps}", "checkpoint.every=0", "checkpoint.save_final=false",
            "train.eval_every=50", f"optim.grad_comm_dtype={wire}", f"train.log_every={steps}"]
    args = ["-m", "hpctrain", "train", str(DEMO), "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    subprocess.run(command(4, sys.executable, *args), check=True, cwd=ROOT,
                   env=with_checkout({**os.environ, **launch_env()}))
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def compare(runs: dict[str, list[dict]]) -> dict:
    a, b = ([m["loss"] for m in runs[k]] for k in SIDES)
    rel = np.abs(np.array(b) - np.array(a)) / np.array(a)
    windows = [(lo, min(lo + 50, len(a))) for lo in range(0, len(a), 50)]
    val = {k: [(m["step"], m["val_loss"]) for m in v if "val_loss" in m] for k, v in runs.items()}
    dp = {k: float(np.median([m["comm_bytes"].get("dp", 0) for m in v])) for k, v in runs.items()}
    return {"steps": len(a), "max_rel": float(rel.max()), "mean_rel": float(rel.mean()),
            "windows": [{"steps": f"{lo + 1}-{hi}", "f32": float(np.mean(a[lo:hi])),
                         "bf16": float(np.mean(b[lo:hi])),
                         "mean_rel": float(rel[lo:hi].mean())} for lo, hi in windows],
            "val_loss": val, "dp_bytes_per_step": dp}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grad_comm_loss")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--out", default="", help="write the comparison here as JSON")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another override for both runs (e.g. train.seed=7)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hpct-wire-") as d:
        runs = {k: train(Path(d) / k, args.steps, v, args.set) for k, v in SIDES.items()}
    res = compare(runs)
    print(f"training loss, bfloat16 vs float32 traffic over {res['steps']} steps: mean "
          f"relative difference {res['mean_rel']:.2e}, max {res['max_rel']:.2e}")
    print("| steps | float32 traffic | bfloat16 traffic | mean relative difference |")
    print("|---|---|---|---|")
    for w in res["windows"]:
        print(f"| {w['steps']} | {w['f32']:.4f} | {w['bf16']:.4f} | {w['mean_rel']:.1e} |")
    for k, v in res["val_loss"].items():
        print(f"held-out loss, {k} traffic: " + ", ".join(f"{s}: {x:.4f}" for s, x in v))
    print("dp bytes per step: " + ", ".join(f"{k} {v / 1e6:.2f} MB"
                                            for k, v in res["dp_bytes_per_step"].items()))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
