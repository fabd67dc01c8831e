#!/usr/bin/env bash
# The whole suite: unit and end-to-end tests in one pytest process, then the tests that
# must run *inside* MPI ranks (pytest-mpi, --with-mpi) under the launcher of hpctrain/launch.py
# (mpirun, Hydra mpiexec or srun) at 1, 2 and 4 ranks.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
status=0
$PY -m pytest -q -p no:cacheprovider --durations=40 tests/unit tests/e2e "$@" || status=$?
for n in 1 2 4; do
  echo "== tests/mpi on $n ranks ($($PY -m hpctrain.launch --describe))"
  $PY -m hpctrain.launch -n $n -- $PY -m mpi4py -m pytest -q -p no:cacheprovider --with-mpi \
      tests/mpi "$@" || status=$?
done
exit $status
