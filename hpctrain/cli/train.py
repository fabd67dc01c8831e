"""``hpctrain train CONFIG --run-dir DIR [--set section.key=value ...]``"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("config", help="TOML preset, e.g. share/configs/demo.toml")
    p.add_argument("--run-dir", required=True, help="where metrics, logs and checkpoints go")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)")


def run(args) -> int:
    from .. import comm, slurm
    from ..checks.validate import validate
    from ..config import ConfigError, load

    world = comm.world()
    if (wrong_launch := slurm.launch_error(world.size, comm.library())) is not None:
        print(f"hpctrain train: {wrong_launch}", file=sys.stderr, flush=True)
        return 2
    try:
        cfg = load(args.config, args.overrides)
        validate(cfg, world.size)
        check_inputs(cfg, args.run_dir)
    except ConfigError as e:  # InputError too: raised deliberately, never a bug's exception
        # Every rank reaches the same verdict before any collective: exit, no abort.
        return refused(world, e)
    from ..checkpoint.background import CheckpointFailed
    from ..checkpoint.lineage import LineageError
    from ..train import train

    try:
        train(cfg, args.run_dir, world)
    except LineageError as e:  # raised alike on every rank (the checkpoint's attributes)
        return refused(world, e)
    except CheckpointFailed as e:  # raised alike on every rank, one step after the failure
        print(f"hpctrain train: rank {world.rank}: {e}", file=sys.stderr, flush=True)
        world.barrier()  # every rank has said it
        comm.abort(1)  # writer threads may still wait in a collective: end them too
    return 0


def refused(world, why) -> int:
    """A verdict every rank reached alike: rank 0 says it, every rank ends with status 2.
    With more than one rank, MPI is finalised and the process exits here: returning 2 under
    ``python -m mpi4py`` would ``MPI_Abort`` each rank, and an abort from a rank that had
    nothing to say can end the job before rank 0's message is out (MPICH's Hydra)."""
    if world.rank == 0:
        print(f"hpctrain train: {why}", file=sys.stderr, flush=True)
    if world.size == 1:
        return 2  # one process (also in-process callers): the caller exits
    sys.stdout.flush()
    from .. import comm

    comm.finalize()  # collective: every rank is here, no collective was left half done
    os._exit(2)


def check_inputs(cfg, run_dir: str) -> None:
    """What a valid config points at, before any collective and before anything is written:
    the data (:func:`data_problems`), the run and checkpoint directories (writable, or
    creatable), the checkpoint to resume from. Only reads, so every rank reaches the same
    verdict on a shared file system. Raises :class:`~hpctrain.config.InputError`."""
    from ..config import InputError
    from ..interchange import init_from

    errors = _dir_problems(f"--run-dir {run_dir}", run_dir)
    if cfg.checkpoint.dir:
        errors += _dir_problems(f"checkpoint.dir={cfg.checkpoint.dir}", cfg.checkpoint.dir)
    resume = cfg.checkpoint.resume
    if resume not in ("", "auto") and not Path(resume).exists():
        errors.append(f"checkpoint.resume={resume!r}: no checkpoint there")
    errors += data_problems(cfg)
    errors += init_from.problems(cfg)
    if len(errors) == 1:
        raise InputError(errors[0])
    if errors:
        raise InputError("invalid input:\n  - " + "\n  - ".join(errors))


def data_problems(cfg, missing_ok: bool = False) -> list[str]:
    """Why the model cannot train on its data: the file is missing, damaged or not
    hpctrain's, a token id has no row in ``model.vocab_size``, a split is too short. Reads
    the file's attributes (the embedded corpus: its tokens, once). ``missing_ok``: a data
    file that is not here is no problem (``hpctrain plan`` on another machine)."""
    from ..data.dataset import DataError, fit_problems, summarize

    d, t = cfg.data, cfg.train
    if missing_ok and any(p and not Path(p).exists() for p in (d.path, d.tokenizer)):
        return []
    try:
        s = summarize(d.path, d.corpus_mb, d.val_fraction, d.tokenizer)
    except DataError as e:
        return [str(e)]
    return fit_problems(s, cfg.model.vocab_size, t.seq_len, t.eval_every)


def _dir_problems(what: str, path: str) -> list[str]:
    """[] when ``path`` is a writable directory or can be created (its nearest existing
    ancestor is a writable directory)."""
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            return [f"{what} exists and is not a directory"]
        target = p if p.exists() else next(a for a in p.absolute().parents if a.exists())
        if not target.is_dir():
            return [f"{what}: {target} is not a directory"]
        if not os.access(target, os.W_OK | os.X_OK):
            return [f"{what}: {target} is not writable"]
    except OSError as e:  # e.g. a parent that cannot be searched
        return [f"{what}: {e.strerror or e}"]
    return []
