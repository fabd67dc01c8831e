"""``hpctrain launch -n N -- COMMAND``: start COMMAND on N ranks with the launcher this
machine has (Open MPI ``mpirun``, Hydra ``mpiexec`` or ``srun``), with the flags each needs for
more ranks than cores, root, binding and environment passing (:mod:`hpctrain.job.launch`);
``--relaunch N``: relaunch a failed training step on the hosts left
(:mod:`hpctrain.job.relaunch`)."""

from __future__ import annotations

from ..job import launch, relaunch


def add_arguments(p) -> None:
    launch.add_arguments(p)
    relaunch.add_arguments(p)


def run(args) -> int:
    """A launch; with ``--relaunch N`` and a command, the relaunch loop
    (:mod:`hpctrain.job.relaunch`)."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.relaunch is not None and command:
        return relaunch.run(args, command)
    return launch.run(args)
