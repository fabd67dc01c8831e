"""What a batch job resolves before it starts ranks, asked by ``jobs/env.sh`` (the templates,
``jobs/dry-run.sh``, ``hpctrain submit``) so that the login node and the compute node decide
alike:

* ``layout``: the topology overrides that fit the config to the job's task count. The
  config's own layout when it multiplies to the tasks; ``topology.dp`` filled in only when
  neither the config nor a ``--set`` gives it; anything else refused (exit 2) with both
  numbers and the ways out.
* ``run-name``: a run's identity across submissions (default: the config's stem), which names
  its run directory; a job id never does, so a resubmission or the next job of a chain
  continues the run.
* ``preflight``: every check ``hpctrain train`` makes at start (config, layout against the
  tasks, data and tokenizer, directories, the checkpoint to resume) and the run directory's
  state: new, continues from step N, or refused. Reads only.
* ``root``: the checkout of this hpctrain (found from the interpreter), whose ``jobs/env.sh``
  the templates source.

From the shell: ``python -m hpctrain.cli.batch layout --tasks 32 CONFIG [--set K=V ...]``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ..job.launch import ROOT
from ..job.slurm import run_name

AXES = ("dp", "tp", "pp", "cp")  # world = dp * tp * pp * cp (ep is carved out of dp)


class BatchError(Exception):
    """A job that cannot start as asked: said once, exit 2, nothing submitted or changed."""


def explicit_keys(config: str | None, sets: list[str]) -> set[str]:
    """The ``section.key`` names the config file or a ``--set`` gives (legacy names read)."""
    from ..config import load, renamed, upgrade
    from ..config.values import parse_override, tomllib

    load(config, sets)  # the config and every override are valid (ConfigError otherwise)
    raw = upgrade(tomllib.loads(Path(config).read_text(encoding="utf-8"))) if config else {}
    given = {f"{s}.{k}" for s, body in raw.items() if isinstance(body, dict) for k in body}
    for text in sets:
        section, key, _ = parse_override(text)
        given.add(".".join(renamed(section, key)))
    return given


def layout(config: str | None, sets: list[str], tasks: int) -> list[str]:
    """The ``--set`` values (``topology.dp=K`` or none) that make the config's layout use
    ``tasks`` ranks; BatchError when it cannot."""
    from ..config import load

    topo = load(config, sets).topology
    sizes = {a: getattr(topo, a) for a in AXES}
    world = sizes["dp"] * sizes["tp"] * sizes["pp"] * sizes["cp"]
    if world == tasks:
        return []
    inner = world // sizes["dp"]
    shape = " * ".join(f"{a}={sizes[a]}" for a in AXES)
    if "topology.dp" in explicit_keys(config, sets):
        raise BatchError(
            f"{config or 'the defaults'}: the layout {shape} needs {world} ranks but the job "
            f"has {tasks} tasks; ask for {world} tasks (e.g. --nodes/--ntasks-per-node), or "
            f"change the layout (--set topology.dp=N; hpctrain plan CONFIG --search --nodes N "
            "finds one)")
    if tasks % inner:
        raise BatchError(
            f"{config or 'the defaults'}: tp * pp * cp = {inner} does not divide the job's "
            f"{tasks} tasks, so no topology.dp fills them; ask for a multiple of {inner} "
            "tasks, or change the layout (--set topology.tp=..., topology.pp=...)")
    return [f"topology.dp={tasks // inner}"]


def run_state(cfg, run_dir: str) -> str:
    """What ``hpctrain train`` will do in ``run_dir``: start anew or continue (and from which
    checkpoint). Problems (a fresh start over checkpoints, a missing checkpoint) are
    :func:`~hpctrain.checks.inputs.check_inputs`'s."""
    from ..checkpoint.checkpointer import candidates

    resume = cfg.checkpoint.resume
    if resume in ("", "never"):
        return "new run (checkpoint.resume=never)"
    ckpt_dir = Path(cfg.checkpoint.dir or Path(run_dir) / "checkpoints")
    found = candidates(resume, ckpt_dir)
    if not found:
        return "new run (no checkpoint in " + str(ckpt_dir) + ")"
    step = re.search(r"step_(\d+)", found[0].name)
    at = f"step {int(step.group(1))}" if step else "its step"
    return f"continues from {at} ({found[0]})"


def preflight(config: str | None, sets: list[str], tasks: int, run_dir: str) -> str:
    """Every check the job's ``hpctrain train`` makes before its first collective, on this
    machine, with the layout :func:`layout` resolves; the run directory's state."""
    from ..checks.inputs import check_inputs
    from ..checks.validate import validate
    from ..config import load
    from .train import check_peak

    cfg = load(config, [*sets, *layout(config, sets, tasks)])
    validate(cfg, tasks)
    check_inputs(cfg, run_dir)
    check_peak(cfg)
    t = cfg.topology
    return (f"layout dp={t.dp} (ep={t.ep}) x tp={t.tp} x pp={t.pp} x cp={t.cp} = {tasks} "
            f"ranks\nrun directory {run_dir}: {run_state(cfg, run_dir)}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hpctrain.cli.batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("root", help="the checkout of this hpctrain (jobs/env.sh is there)")
    name = sub.add_parser("run-name", help="the run's name")
    name.add_argument("config", nargs="?")
    name.add_argument("--name", default="")
    for what in ("layout", "preflight"):
        s = sub.add_parser(what)
        s.add_argument("--tasks", type=int, required=True)
        s.add_argument("config")
        s.add_argument("--set", dest="sets", action="append", default=[])
        if what == "preflight":
            s.add_argument("--run-dir", required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    from ..config import ConfigError

    args, _ = _parser().parse_known_args(argv)  # train's other arguments pass through
    try:
        if args.what == "root":
            print(ROOT)
        elif args.what == "run-name":
            print(run_name(args.config, args.name))
        elif args.what == "layout":
            print("\n".join(layout(args.config, args.sets, args.tasks)))
        else:
            print(preflight(args.config, args.sets, args.tasks, args.run_dir))
    except (BatchError, ConfigError, ValueError) as e:  # InputError is a ConfigError
        print(f"hpctrain: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
