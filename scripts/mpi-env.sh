# The local settings of the MPI launcher in use, for a shell: `source scripts/mpi-env.sh`
# (as root, more ranks than cores). The settings themselves live in ONE place,
# hpctrain/job/launch.py (the launcher abstraction: Open MPI mpirun, Hydra mpiexec, srun),
# which the Makefile, tests/run_all.sh, tests/launch.py and the benchmarks use directly.
# PY (default python3) picks the interpreter, and with it the MPI its mpi4py was built for.
_hpctrain_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
eval "$(cd "$_hpctrain_root" && "${PY:-python3}" -m hpctrain.job.launch --exports)"
unset _hpctrain_root
