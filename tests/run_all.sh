#!/usr/bin/env bash
# The whole suite, in phases, each timed:
#   1. unit and end-to-end tests in one pytest process (tests/unit, tests/e2e: the real CLI
#      under the launcher, real SLURM, real process deaths);
#   2. the tests that run *inside* MPI ranks (pytest-mpi, --with-mpi) under the launcher of
#      hpctrain/launch.py (mpirun, Hydra mpiexec or srun) at 1, 2 and 4 ranks (tests/mpi);
#   3. the equivalence matrix, every layout against one rank inside one launch of 8 ranks
#      (tests/matrix, tests/inprocess.py).
# Then the 25 slowest tests of phases 1 and 3 and each phase's seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=${HPCTRAIN_TEST_OUT:-runs/tests}
mkdir -p "$out"
status=0
phases=()
phase() {  # NAME COMMAND...: run it, remember its time and status
  local name=$1 t0=$SECONDS
  shift
  echo "== $name"
  "$@" || status=$?
  phases+=("$name: $((SECONDS - t0)) s")
}
phase "unit + e2e" $PY -m pytest -q -p no:cacheprovider --durations=25 \
  --junitxml="$out/unit-e2e.xml" tests/unit tests/e2e "$@"
for n in 1 2 4; do
  phase "tests/mpi on $n ranks ($($PY -m hpctrain.launch --describe))" \
    $PY -m hpctrain.launch -n $n -- $PY -m mpi4py -m pytest -q -p no:cacheprovider --with-mpi \
      tests/mpi "$@"
done
phase "equivalence matrix on 8 ranks" $PY -m hpctrain.launch -n 8 -- $PY -m mpi4py \
  -m pytest -q -p no:cacheprovider --with-mpi --junitxml="$out/matrix.xml" tests/matrix "$@"
$PY tests/slowest.py 25 "$out/unit-e2e.xml" "$out/matrix.xml"
printf '%s\n' "== phases" "${phases[@]}"
exit $status
