#!/usr/bin/env bash
# Set up what is missing for hpctrain, idempotently: an MPI and its parallel HDF5, then a
# virtual environment with torch, numpy, mpi4py and h5py (HDF5_MPI=ON) built against them.
# A second run skips what is done. The MPI follows the site (docs/slurm.md):
#   * MPICC or HDF5_DIR given (a loaded module: `module load cray-mpich cray-hdf5-parallel`):
#     that mpicc and that HDF5, nothing installed; mpi4py is built from source against it.
#   * MPI_IMPL=mpich on a Debian machine: MPICH and its parallel HDF5 from apt (as root).
#   * otherwise (the default): Open MPI and its parallel HDF5 from apt when missing, and
#     mpi4py's binary wheel (it matches Debian's Open MPI).
# An MPI and an HDF5 built for different MPI families stop set-up with both names.
#
# Overridable:  MPI_IMPL (openmpi | mpich), MPICC, HDF5_DIR (parallel HDF5 prefix),
#               TORCH_SPEC (default torch==2.13.0, the CPU build), PYTHON (default python3),
#               VENV (default .venv; .venv-mpich is the usual second one), HPCTRAIN_EXTRAS,
#               BASE_VENV (a set-up venv of the same Python whose MPI-free packages, torch
#               and the rest, this one reuses: only mpi4py and h5py are built here; the
#               site-stack CI job uses it to avoid a second torch),
#               SETUP_PART (all | system: stop after the system packages, steps 0-1; CI
#               installs them first so that apt never runs beside the SLURM tests' apt).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
say() { echo "[setup] $*"; }
case "${SETUP_PART:=all}" in all | system) ;;
  *) say "SETUP_PART must be all or system, got '$SETUP_PART'" >&2; exit 1 ;; esac
# shellcheck source=scripts/mpi-family.sh
source scripts/mpi-family.sh

# 0. iproute2 (ip, tc) for the simulated multi-node cluster (scripts/cluster.sh), as root.
can_apt() { command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; }
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "$@" >/dev/null
}
if ! command -v tc >/dev/null 2>&1 && can_apt; then
  say "installing iproute2 (simulated cluster) with apt"
  apt_install iproute2 || true
fi

# 1. The MPI and its parallel HDF5: the site's (MPICC / HDF5_DIR), or Debian's MPI_IMPL.
MPI_IMPL=${MPI_IMPL:-openmpi}
HDF5_DIR=${HDF5_DIR:-${HDF5_ROOT:-}}
debian_hdf5() {  # family -> Debian's parallel HDF5 prefix for it (empty when absent)
  local d
  for d in /usr/lib/x86_64-linux-gnu/hdf5/$1 /usr/lib/aarch64-linux-gnu/hdf5/$1; do
    [ -d "$d" ] && { echo "$d"; return; }
  done
}
no_stack() {
  cat >&2 <<MSG
[setup] $1, and apt is not usable here (not root, or no apt).
        On a cluster, load your site's MPI and the parallel HDF5 built with it, e.g.
            module load cray-mpich cray-hdf5-parallel     (Cray; names vary by site)
            module load openmpi hdf5/parallel python      (generic)
        then run again with HDF5_DIR=<parallel HDF5 prefix> (and MPICC=<its mpicc> when
        it is not \`mpicc\`). See docs/slurm.md.
MSG
  exit 1
}
SOURCE_MPI4PY=1  # mpi4py from source against MPICC; the binary wheel only for Debian Open MPI
if [ -n "${MPICC:-}" ] || [ -n "$HDF5_DIR" ]; then
  MPICC=${MPICC:-mpicc}
  command -v "$MPICC" >/dev/null 2>&1 || no_stack "MPICC=$MPICC is not on the PATH"
  [ -n "$HDF5_DIR" ] || no_stack "MPICC=$MPICC given but no HDF5_DIR (its parallel HDF5)"
  say "using the MPI on the path: $(command -v "$MPICC"), HDF5 in $HDF5_DIR"
elif [ "$MPI_IMPL" = mpich ]; then
  MPICC=mpicc.mpich
  if ! command -v mpicc.mpich >/dev/null 2>&1 || ! command -v mpiexec.mpich >/dev/null 2>&1 \
     || [ -z "$(debian_hdf5 mpich)" ]; then
    can_apt || no_stack "MPI_IMPL=mpich: MPICH or its parallel HDF5 is missing"
    say "installing MPICH and the MPICH build of parallel HDF5 with apt"
    apt_install mpich libmpich-dev libhdf5-mpich-dev hdf5-tools pkg-config
  fi
  HDF5_DIR=$(debian_hdf5 mpich)
elif [ "$MPI_IMPL" = openmpi ]; then
  MPICC=mpicc
  if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1 \
     || [ -z "$(debian_hdf5 openmpi)" ]; then
    can_apt || no_stack "mpicc / Open MPI's parallel HDF5 not found"
    say "installing Open MPI and the Open MPI build of parallel HDF5 with apt"
    apt_install openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools pkg-config
  fi
  HDF5_DIR=$(debian_hdf5 openmpi)
  SOURCE_MPI4PY=0
else
  say "MPI_IMPL must be openmpi or mpich, got '$MPI_IMPL'" >&2
  exit 1
fi
export HDF5_DIR MPICC
# The MPI and the HDF5 must be one family (an HDF5 for Open MPI cannot run under MPICH).
mpi_fam=$(mpicc_family "$MPICC") || { say "$MPICC cannot build an MPI program" >&2; exit 1; }
h5_fam=$(hdf5_family "$HDF5_DIR")
if [ "$mpi_fam" != unknown ] && [ "$h5_fam" != unknown ] && [ "$mpi_fam" != "$h5_fam" ]; then
  cat >&2 <<MSG
[setup] the MPI and the HDF5 do not belong together:
          MPI:  $(command -v "$MPICC") is $(mpi_family_name "$mpi_fam")
          HDF5: $HDF5_DIR is built for $(mpi_family_name "$h5_fam")
        Load the parallel HDF5 of the same MPI (Cray: cray-hdf5-parallel after cray-mpich;
        Debian: $(debian_hdf5 "$mpi_fam" || true)) and set HDF5_DIR to it, or MPICC to the
        mpicc of the MPI that HDF5 was built with.
MSG
  exit 1
fi
hdf5_is_parallel "$HDF5_DIR" || { say "$HDF5_DIR is a serial HDF5: load the parallel one" >&2; exit 1; }
say "MPI: $(mpi_family_name "$mpi_fam") via $MPICC; parallel HDF5: $HDF5_DIR"
[ "$SETUP_PART" != system ] || exit 0

# 2. The virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP="$PY -m pip --disable-pip-version-check -q"
if [ -n "${BASE_VENV:-}" ]; then  # reuse BASE_VENV's torch & co; this venv's own come first
  base_site=$("$BASE_VENV/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))") \
    || { say "BASE_VENV=$BASE_VENV is not a working venv: run \`make setup\` first" >&2; exit 1; }
  own_site=$("$PY" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
  [ "$base_site" != "$own_site" ] || { say "BASE_VENV is VENV itself" >&2; exit 1; }
  echo "import site; site.addsitedir('$base_site')" > "$own_site/hpctrain-base-venv.pth"
  say "reusing the MPI-free packages of $BASE_VENV (torch: not installed again)"
fi
# The stamp names the torch build and the package list: a changed list installs again.
# megatron-core (one wheel, no new dependencies): the tests write real Megatron-Core
# torch_dist checkpoints with it (tests/e2e/megatron_writer.py; its writer processes need
# psutil); hpctrain does not import it.
BASE_PKGS="numpy cython pkgconfig pytest pytest-mpi pytest-timeout pytest-xdist==3.8.0 hypothesis ruff
  matplotlib safetensors tokenizers==0.23.3 transformers==5.23.0 pyarrow zstandard
  tensorboard==2.21.0 wandb==0.31.0 megatron-core==0.16.1 psutil"
[ "$SOURCE_MPI4PY" = 1 ] || BASE_PKGS="$BASE_PKGS mpi4py>=4"
stamp="$VENV/.hpctrain-base-$(echo "$TORCH_SPEC $BASE_PKGS" | cksum | cut -d' ' -f1)"
if [ -n "${BASE_VENV:-}" ] && ls "$BASE_VENV"/.hpctrain-base-* >/dev/null 2>&1; then
  $PIP install --upgrade pip setuptools wheel >/dev/null  # what builds mpi4py and h5py
elif [ ! -f "$stamp" ]; then
  say "installing $TORCH_SPEC, numpy, test tools"
  $PIP install --upgrade pip setuptools wheel >/dev/null
  # shellcheck disable=SC2086  # BASE_PKGS is a word list
  $PIP install "$TORCH_SPEC" $BASE_PKGS
  touch "$stamp"
fi
# torchtitan: the tests write real torchtitan interval saves with its own CheckpointManager,
# optimizer, scheduler and data loader (tests/e2e/titan_manager_writer.py); hpctrain does
# not import it. --no-deps because its declared dependencies are its trainer's (datasets,
# einops, ...); those modules import only the packages listed with it here (its models also
# need triton, which the tests do not use). Own stamp, so the base list is not reinstalled.
TITAN_PKGS="torchtitan==0.3.0 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1
  spmd-types==0.2.3 torchdata==0.11.0"
titan_stamp="$VENV/.hpctrain-titan-$(echo "$TITAN_PKGS" | cksum | cut -d' ' -f1)"
if [ -n "${BASE_VENV:-}" ] && ls "$BASE_VENV"/.hpctrain-titan-* >/dev/null 2>&1; then
  :  # BASE_VENV's, through its site directory
elif [ ! -f "$titan_stamp" ]; then
  say "installing torchtitan's checkpoint modules (without its trainer's dependencies)"
  # shellcheck disable=SC2086  # TITAN_PKGS is a word list
  $PIP install --no-deps $TITAN_PKGS
  rm -f "$VENV"/.hpctrain-titan-*
  touch "$titan_stamp"
fi
# mpi4py and h5py are built for one (MPICC, HDF5_DIR): a stamp names it, another rebuilds.
build_key=$(echo "$(command -v "$MPICC") $("$MPICC" -show 2>/dev/null || true) $HDF5_DIR" \
  | cksum | cut -d' ' -f1)
# The wheels built for a build key are kept per machine (HPCTRAIN_WHEELS), so another clone
# or venv of the same Python installs them in seconds instead of compiling again.
WHEELS=${HPCTRAIN_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/hpctrain/wheels}/$build_key-$("$PY" -c \
  'import sys; print("py%d%d" % sys.version_info[:2])')
built_wheel() {  # NAME SPEC [VAR=VALUE ...]: install NAME's wheel for this key, built once
  local name=$1 spec=$2
  shift 2
  if ! ls "$WHEELS/$name"-*.whl >/dev/null 2>&1; then
    mkdir -p "$WHEELS"
    env "$@" $PIP wheel --no-binary="$name" --no-build-isolation --no-cache-dir --no-deps \
      -w "$WHEELS" "$spec"
  else
    say "$name: the wheel built before on this machine ($WHEELS)"
  fi
  $PIP install --force-reinstall --no-deps "$WHEELS/$name"-*.whl
}
if [ "$SOURCE_MPI4PY" = 1 ] && [ ! -f "$VENV/.hpctrain-mpi4py-$build_key" ]; then
  say "building mpi4py from source against $MPICC (about 3 minutes, once per machine)"
  built_wheel mpi4py "mpi4py>=4" MPICC="$MPICC"
  rm -f "$VENV"/.hpctrain-mpi4py-*
  touch "$VENV/.hpctrain-mpi4py-$build_key"
fi
h5_ok() {  # this venv's own h5py (not BASE_VENV's), built for MPI
  "$PY" -c "import h5py, sys; sys.exit(0 if h5py.get_config().mpi and
    h5py.__file__.startswith(sys.prefix) else 1)" 2>/dev/null
}
if h5_ok && ! ls "$VENV"/.hpctrain-h5py-* >/dev/null 2>&1; then
  touch "$VENV/.hpctrain-h5py-$build_key"  # a venv from before the stamps: adopt its h5py
fi
if ! h5_ok || [ ! -f "$VENV/.hpctrain-h5py-$build_key" ]; then
  say "building h5py against parallel HDF5 in $HDF5_DIR (about 3 minutes, once per machine)"
  # No build isolation: with it pip compiles an old mpi4py from source (20+ GB of RAM).
  built_wheel h5py h5py HDF5_MPI=ON CC="$MPICC" HDF5_DIR="$HDF5_DIR"
  if ! h5_ok; then  # a kept wheel that does not work here: build it again
    rm -f "$WHEELS"/h5py-*.whl
    built_wheel h5py h5py HDF5_MPI=ON CC="$MPICC" HDF5_DIR="$HDF5_DIR"
  fi
  rm -f "$VENV"/.hpctrain-h5py-*
  touch "$VENV/.hpctrain-h5py-$build_key"
fi
PY_ABS="$(cd "$VENV" && pwd)/bin/python"
here=$(pwd -P)
if ! (cd / && "$PY_ABS" -c "import hpctrain, pathlib, sys; sys.exit(0 if pathlib.Path(
      hpctrain.__file__).resolve().is_relative_to('$here') else 1)" 2>/dev/null); then
  # not via the cwd, and this checkout's (not another one's through BASE_VENV)
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
