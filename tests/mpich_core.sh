#!/usr/bin/env bash
# The site-stack CI job (issue 24): the equivalence core under MPICH on the same machine.
#   1. set-up: MPI_IMPL=mpich VENV=.venv-mpich scripts/setup.sh (MPICH and its parallel HDF5
#      from apt as root; mpi4py and h5py built from source against them, torch and the rest
#      reused from the Open MPI venv through BASE_VENV; a second run skips what is done);
#   2. tests/site/test_mpi_core.py with that interpreter: dp x tp + SP + ZeRO-1, pp 1F1B (its
#      checkpoint resumed at dp x tp), pp interleaved and ep against one rank; a file written
#      under Open MPI (OTHER_PY, default .venv/bin/python: run `make setup` first) verified
#      and resumed under MPICH, and an MPICH file verified under Open MPI.
# Prints the seconds of each part. `.ci/run` runs it after `make test` (`make test-mpich`);
# run it from the repository root or anywhere: bash tests/mpich_core.sh [PYTEST_ARGS]
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-mpich}
export OTHER_PY=${OTHER_PY:-$PWD/.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}
[ -x "$OTHER_PY" ] || { echo "[mpich-core] $OTHER_PY missing: run \`make setup\` (Open MPI) first" >&2; exit 2; }
t0=$(date +%s)
MPI_IMPL=mpich VENV=$VENV BASE_VENV=${BASE_VENV-$(dirname "$(dirname "$OTHER_PY")")} \
  bash scripts/setup.sh || { echo "[mpich-core] set-up failed" >&2; exit 2; }
t1=$(date +%s)
"$VENV/bin/python" -m hpctrain.job.launch --describe
"$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=10 tests/site "$@"
status=$?
t2=$(date +%s)
echo "[mpich-core] set-up $((t1 - t0)) s, tests $((t2 - t1)) s ($(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg))"
exit $status
