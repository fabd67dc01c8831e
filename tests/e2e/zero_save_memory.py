"""Peak memory of a ZeRO checkpoint save against a training step, per rank (run under mpirun
by tests/e2e/test_zero_save_memory.py; prints one JSON line per rank).

``python -m mpi4py tests/e2e/zero_save_memory.py RUN_DIR [--set key=value ...]``: sets up the
real trainer (tiny preset widened so that the optimizer state dominates what a rank holds),
runs one warm-up step, then measures the resident-set high-water mark (``VmHWM``, reset
through ``/proc/self/clear_refs``) over one more step and over one save of that state.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "share/configs/tiny.toml"
WIDE = ("model.d_model=512", "model.d_ff=2048", "model.n_layers=4", "optim.bucket_mb=4",
        "topology.dp=4", "optim.zero=1", "checkpoint.save_final=false", "train.steps=3")


def _status(key: str) -> int:
    """A /proc/self/status field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5\n")  # VmHWM := VmRSS (Linux >= 4.0)


def measure(fn) -> dict:
    """RSS before, high-water mark during ``fn()``, bytes."""
    _reset_peak()
    before = _status("VmRSS")
    fn()
    return {"rss_before": before, "peak": _status("VmHWM")}


def main(argv: list[str]) -> None:
    from hpctrain import comm
    from hpctrain.config import load
    from hpctrain.train import setup, train_step

    run_dir, overrides = Path(argv[0]), [*WIDE, *argv[1:]]
    cfg = load(str(TINY), overrides)
    world = comm.world()
    tr = setup(cfg, run_dir, world)
    train_step(tr, 0)  # warm-up: every buffer of a step exists after it
    world.barrier()
    step = measure(lambda: train_step(tr, 1))
    world.barrier()
    save = measure(lambda: tr.ckpts.saver.save(2, tr.params, tr.optimizer, tr.ckpt_attrs))
    out = {"rank": world.rank, "step": step, "save": save,
           "optimizer_bytes": tr.optimizer.state_bytes(),
           "param_bytes": sum(p.numel() * p.element_size() for _, p in tr.params)}
    for r in range(world.size):
        if r == world.rank:
            print("MEM " + json.dumps(out), flush=True)
        world.barrier()


if __name__ == "__main__":
    main(sys.argv[1:])
