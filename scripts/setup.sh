#!/usr/bin/env bash
# Set up what is missing for hpctrain, idempotently: system MPI + parallel HDF5 (apt, when
# root and apt exist), then .venv with torch, numpy, mpi4py (linked to the system MPI) and
# h5py built from source with HDF5_MPI=ON. A second run skips what is done.
#
# Overridable:  TORCH_SPEC (default torch==2.13.0, the CPU build), PYTHON (default python3),
#               HDF5_DIR (parallel HDF5 prefix), VENV (default .venv), HPCTRAIN_EXTRAS.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
say() { echo "[setup] $*"; }

# 0. iproute2 (ip, tc) for the simulated multi-node cluster (scripts/cluster.sh), as root.
if ! command -v tc >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
   && [ "$(id -u)" = 0 ]; then
  say "installing iproute2 (simulated cluster) with apt"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null || true
fi

# 1. System MPI and parallel HDF5.
if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1 \
   || { [ -z "${HDF5_DIR:-}" ] && [ ! -d /usr/lib/x86_64-linux-gnu/hdf5/openmpi ] \
        && [ ! -d /usr/lib/aarch64-linux-gnu/hdf5/openmpi ]; }; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing Open MPI and the Open MPI build of parallel HDF5 with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools \
      pkg-config >/dev/null
  else
    cat >&2 <<'MSG'
[setup] mpicc / parallel HDF5 not found and apt is not usable here.
        On a cluster, load your site's stack first, for example:
            module load openmpi hdf5/parallel python      (names vary by site)
        then set HDF5_DIR to the parallel HDF5 prefix and run `make run` again.
MSG
    exit 1
  fi
fi
if [ -z "${HDF5_DIR:-}" ]; then
  for d in /usr/lib/x86_64-linux-gnu/hdf5/openmpi /usr/lib/aarch64-linux-gnu/hdf5/openmpi; do
    [ -d "$d" ] && HDF5_DIR=$d
  done
fi
export HDF5_DIR

# 2. The virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP="$PY -m pip --disable-pip-version-check -q"
# The stamp names the torch build and the package list: a changed list installs again.
BASE_PKGS="numpy cython pkgconfig mpi4py>=4 pytest pytest-mpi pytest-timeout hypothesis ruff
  matplotlib safetensors tokenizers==0.23.3 transformers==5.23.0"
stamp="$VENV/.hpctrain-base-$(echo "$TORCH_SPEC $BASE_PKGS" | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
  say "installing $TORCH_SPEC, numpy, mpi4py, test tools"
  $PIP install --upgrade pip setuptools wheel >/dev/null
  # shellcheck disable=SC2086  # BASE_PKGS is a word list
  $PIP install "$TORCH_SPEC" $BASE_PKGS
  touch "$stamp"
fi
if ! "$PY" -c "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)" 2>/dev/null; then
  say "building h5py against parallel HDF5 in $HDF5_DIR (about 2 minutes)"
  # No build isolation: with it pip compiles an old mpi4py from source (20+ GB of RAM).
  HDF5_MPI=ON CC=mpicc $PIP install --no-binary=h5py --no-build-isolation --no-cache-dir \
      --force-reinstall --no-deps h5py
fi
PY_ABS="$(cd "$VENV" && pwd)/bin/python"
if ! (cd / && "$PY_ABS" -c "import hpctrain" 2>/dev/null); then  # not via the cwd
  say "installing hpctrain (editable)"
  $PIP install --no-build-isolation --no-deps -e . >/dev/null
fi
"$PY" - <<'PY'
import h5py, mpi4py, torch
from mpi4py import MPI
print(f"[setup] ok: torch {torch.__version__}, mpi4py {mpi4py.__version__} "
      f"({MPI.Get_library_version().splitlines()[0].strip()}), h5py {h5py.__version__} "
      f"(mpi={h5py.get_config().mpi})")
PY
