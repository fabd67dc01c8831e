#!/usr/bin/env bash
# GPU check for hpctrain, on one GPU with 2 ranks sharing it (fits in 10 minutes on an H200):
#   1. dp=2 and tp=2 equivalence against 1 rank with model.device=cuda (float64, <= 1e-9)
#   2. allreduce bandwidth through comm.py vs a raw CuPy-buffer MPI Allreduce
#   3. MFU of a ~100M-parameter model step on one rank vs a plain PyTorch loop
# Usage (repo root):  bash tests/gpu/check.sh [OUT_DIR]      results -> OUT_DIR/gpu_results.md
# Needs: torch with CUDA, mpi4py + an MPI (`mpirun`), h5py; cupy optional (else torch's own
# __cuda_array_interface__). Where no MPI can be installed, carry wheels in .whl/ (mpi4py,
# the Open MPI wheels it can use, h5py, cupy): they are installed into /tmp/site first.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-${OUT:-runs/gpu-check}}
mkdir -p "$OUT"
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
source scripts/mpi-env.sh  # Open MPI as root, oversubscription, yield when idle
export OMP_NUM_THREADS=4
export HDF5_USE_FILE_LOCKING=FALSE PYTHONUNBUFFERED=1
MPIRUN=${MPIRUN:-mpirun}
R="$OUT/gpu_results.md"
{
  echo "# hpctrain GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  $PY -c "import torch, mpi4py; from mpi4py import MPI; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| mpi4py', mpi4py.__version__, '|', MPI.Get_library_version().splitlines()[0])"
  $PY -c "import cupy; print('cupy', cupy.__version__)" 2>/dev/null || echo "cupy: not installed (torch __cuda_array_interface__ used)"
  echo '```'
} > "$R"

echo "== 1. equivalence on the GPU" | tee -a "$R"
common=(--set model.device=\"cuda\" --set checkpoint.save_final=true)
$PY -m hpctrain train share/configs/tiny.toml --run-dir "$OUT/one" "${common[@]}" > "$OUT/one.log"
$MPIRUN -n 2 --oversubscribe $PY -m mpi4py -m hpctrain train share/configs/tiny.toml \
  --run-dir "$OUT/dp2" --set topology.dp=2 "${common[@]}" > "$OUT/dp2.log"
$MPIRUN -n 2 --oversubscribe $PY -m mpi4py -m hpctrain train share/configs/tiny.toml \
  --run-dir "$OUT/tp2" --set topology.tp=2 "${common[@]}" > "$OUT/tp2.log"
$PY - "$OUT" >> "$R" <<'PY'
import sys
sys.path.insert(0, "tests")
from pathlib import Path
from launch import assert_same, read_run, rel_err
out = Path(sys.argv[1])
ref = read_run(out / "one")
for name in ("dp2", "tp2"):
    run = read_run(out / name)
    assert_same(run, ref, rel=1e-9, what=name)
    print(f"- {name} on cuda equals 1 rank: loss rel err {rel_err(run.losses, ref.losses):.1e}")
PY

echo "== 2. allreduce bandwidth" | tee -a "$R"
$MPIRUN -n 2 --oversubscribe $PY -m mpi4py tests/gpu/allreduce_bw.py >> "$R"

echo "== 3. MFU, ~100M parameters, one rank" | tee -a "$R"
$PY tests/gpu/mfu.py >> "$R"
cat "$R"
