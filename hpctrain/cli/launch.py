"""``hpctrain launch -n N -- COMMAND``: start COMMAND on N ranks with the launcher this
machine has (Open MPI ``mpirun``, Hydra ``mpiexec`` or ``srun``), with the flags each needs for
more ranks than cores, root, binding and environment passing (:mod:`hpctrain.launch`)."""

from __future__ import annotations

from .. import launch


def add_arguments(p) -> None:
    launch.add_arguments(p)


def run(args) -> int:
    return launch.run(args)
