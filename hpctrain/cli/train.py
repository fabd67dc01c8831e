"""``hpctrain train CONFIG --run-dir DIR [--set section.key=value ...]``"""

from __future__ import annotations

import gc
import sys

from . import refused

DESCRIPTION = """\
Train a model from a TOML config. Every rank of an MPI job runs this command: start it
with mpirun or srun, one rank per core or per GPU; the config's layout (topology.dp, tp,
pp, ep, cp) must multiply to the number of ranks. Writes config.toml, metrics.jsonl,
train.log and checkpoints/ in --run-dir; run again with the same --run-dir to continue
from its newest checkpoint."""

EPILOG = """\
examples:
  mpirun -n 4 hpctrain train share/configs/demo.toml --run-dir runs/demo
  mpirun -n 8 hpctrain train share/configs/tiny-llama.toml --run-dir runs/x \\
      --set topology.dp=2 --set topology.tp=2 --set topology.pp=2
  srun -n 4 hpctrain train share/configs/demo.toml --run-dir $SCRATCH/demo
  hpctrain launch -n 4 -- hpctrain train share/configs/demo.toml \\
      --run-dir runs/demo

(hpctrain launch picks mpirun, mpiexec or srun and the flags each needs; as root or with
more ranks than cores, plain mpirun wants `source scripts/mpi-env.sh` first.) Check a
layout without MPI first: hpctrain plan CONFIG [--set ...]. Every config key (section,
type, default, meaning, allowed values): docs/config.md."""


def add_arguments(p) -> None:
    p.description, p.epilog = DESCRIPTION, EPILOG
    p.add_argument("config", help="TOML preset, e.g. share/configs/demo.toml")
    p.add_argument("--run-dir", required=True, help="where metrics, logs and checkpoints go")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE",
                   help="override one config key, repeatable; the keys are in docs/config.md")


def run(args) -> int:
    # The imports of _run make about 175,000 objects that live as long as the process:
    # collecting while they are made finds nothing (0.1-0.2 s of a core per rank), and once
    # frozen no later collection walks them. The collector is on again however _run ends.
    gc.disable()
    try:
        return _run(args)
    finally:
        gc.enable()


def _run(args) -> int:
    from ..telemetry.startup import note

    note("python")  # the run's start-up phases (telemetry/startup.py)
    from .. import comm
    from ..checks.inputs import check_inputs
    from ..checks.validate import validate
    from ..config import ConfigError, load
    from ..job import slurm

    world = comm.world()
    note("mpi")
    comm.abort_on_exception(world)  # a rank's uncaught exception ends the job, not a hang
    if (wrong_launch := slurm.launch_error(world.size, comm.library())) is not None:
        print(f"hpctrain train: {wrong_launch}", file=sys.stderr, flush=True)
        return 2
    try:
        cfg = load(args.config, args.overrides)
        validate(cfg, world.size)
        check_inputs(cfg, args.run_dir)
        check_peak(cfg)
    except ConfigError as e:  # InputError too: raised deliberately, never a bug's exception
        # Every rank reaches the same verdict before any collective: exit, no abort.
        return refused(world, "train", e)
    note("checks")
    from ..checkpoint.background import CheckpointFailed
    from ..checkpoint.lineage import LineageError
    from ..train import train

    note("torch")
    gc.freeze()
    gc.enable()
    try:
        train(cfg, args.run_dir, world)
    except LineageError as e:  # raised alike on every rank (the checkpoint's attributes)
        return refused(world, "train", e)
    except CheckpointFailed as e:  # raised alike on every rank, one step after the failure
        print(f"hpctrain train: rank {world.rank}: {e}", file=sys.stderr, flush=True)
        world.barrier()  # every rank has said it
        comm.abort(1)  # writer threads may still wait in a collective: end them too
    return 0


def check_peak(cfg) -> None:
    """MFU's nominal peak can be found: ``telemetry.cluster`` names a readable description
    with a ``[peak_flops]`` entry for ``model.dtype`` (InputError otherwise)."""
    from ..config import InputError
    from ..planner.cluster import ClusterError, mfu_peak

    tc = cfg.telemetry
    try:
        mfu_peak(tc.peak_flops, tc.cluster, cfg.model.dtype)
    except ClusterError as e:
        raise InputError(f"telemetry.cluster={tc.cluster!r}: {e}; name a shipped description, "
                         "a file, or set telemetry.peak_flops") from None
