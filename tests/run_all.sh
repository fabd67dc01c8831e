#!/usr/bin/env bash
# The whole suite, in phases, each timed:
#   1. the equivalence matrix: every layout against one rank inside one launch of 8 ranks
#      (tests/matrix, tests/inprocess.py). It is compute-bound, so it runs at low priority
#      beside phase 2, whose launches mostly wait (process start-up, SLURM, faults, timers),
#      and takes the cores they leave idle; its report follows phase 3.
#   2. unit and end-to-end tests (tests/unit, tests/e2e: the real CLI under the launcher, real
#      SLURM, real process deaths) on HPCTRAIN_TEST_WORKERS pytest-xdist workers (default 2:
#      much of an end-to-end test is waiting for processes to start, die and be relaunched,
#      so one worker leaves a core idle), a module's tests on one (tests/conftest.py);
#   3. the tests that run *inside* MPI ranks (pytest-mpi, --with-mpi) under the launcher of
#      hpctrain/job/launch.py (mpirun, Hydra mpiexec or srun) at 1, 2 and 4 ranks (tests/mpi).
# Then the 25 slowest tests of phases 1 and 2 and each phase's seconds.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=${HPCTRAIN_TEST_OUT:-runs/tests}
mkdir -p "$out"
rm -f "$out"/*.xml
status=0
phases=()
phase() {  # NAME COMMAND...: run it, remember its time and status
  local name=$1 t0=$SECONDS
  shift
  echo "== $name"
  "$@" || status=$?
  phases+=("$name: $((SECONDS - t0)) s")
}
matrix() {
  local t0=$SECONDS rc=0
  nice -n 10 $PY -m hpctrain.job.launch -n 8 -- $PY -m mpi4py -m pytest -q -p no:cacheprovider \
    --with-mpi --junitxml="$out/matrix.xml" tests/matrix "$@" || rc=$?
  echo "$rc $((SECONDS - t0))" >"$out/matrix.status"
}
matrix "$@" >"$out/matrix.log" 2>&1 &
beside=$!
workers=${HPCTRAIN_TEST_WORKERS:-2}
phase "unit + e2e ($workers workers)" $PY -m pytest -q -p no:cacheprovider -n "$workers" \
  --dist loadfile --no-loadscope-reorder --junitxml="$out/unit-e2e.xml" tests/unit tests/e2e "$@"
for n in 1 2 4; do
  phase "tests/mpi on $n ranks ($($PY -m hpctrain.job.launch --describe))" \
    $PY -m hpctrain.job.launch -n $n -- $PY -m mpi4py -m pytest -q -p no:cacheprovider --with-mpi \
      tests/mpi "$@"
done
t0=$SECONDS
wait "$beside"
echo "== equivalence matrix on 8 ranks (ran beside the phases above)"
cat "$out/matrix.log"
read -r rc took <"$out/matrix.status" 2>/dev/null || { rc=1; took="?"; }
[ "$rc" = 0 ] || status=$rc
phases+=("equivalence matrix on 8 ranks: $took s (beside; waited $((SECONDS - t0)) s after)")
$PY tests/slowest.py 25 "$out/unit-e2e.xml" "$out/matrix.xml"
printf '%s\n' "== phases" "${phases[@]}"
exit $status
