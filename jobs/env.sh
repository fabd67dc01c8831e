# jobs/env.sh -- sourced by every jobs/*.sbatch (and jobs/dry-run.sh): the site file, the MPI
# environment, and how a template turns its arguments and variables into hpctrain's. A
# template finds this file through the interpreter (`python -m hpctrain.cli.batch env-sh`:
# the installed hpctrain), so it may be submitted from any directory; the job runs in the
# directory it was submitted from, where a config's relative paths resolve.
#
# A template's command line: sbatch [SBATCH OPTIONS] jobs/T.sbatch [CONFIG] [ARGS...]
#   CONFIG     TOML preset (else the CONFIG variable, else share/configs/demo.toml)
#   ARGS       more hpctrain arguments, each kept whole (a value may hold spaces), e.g.
#              --set train.steps=20 --set "checkpoint.dir=/scratch/my runs/ckpt";
#              --run-dir DIR sets RUN_DIR, --run-name NAME sets RUN_NAME
# Arguments reach the job where SBATCH_EXPORT=NONE drops the submitting environment.
#
# Variables (set them in the environment of `sbatch`, which exports it to the job, or in the
# site file, which every job reads):
#   RUN_NAME       the run's identity (default: the config's stem, demo for demo.toml): it
#                  names the run directory, so a resubmission or the next job of a chain
#                  (sbatch --dependency=afterany:JOBID) continues the run
#   RUN_DIR        metrics, logs, checkpoints (default: see hpctrain_run_dir below)
#   LAYOUT         topology overrides, space separated, e.g. "topology.tp=2 topology.dp=4".
#                  Default: the config's own layout when it multiplies to the task count,
#                  topology.dp filled in when the config leaves it open; anything else is
#                  refused (exit 2; jobs/dry-run.sh and `hpctrain submit` refuse it before
#                  the queue)
#   OVERRIDES      more section.key=value overrides, split like a shell line: quote a value
#                  that holds spaces, e.g. OVERRIDES='train.steps=20 "checkpoint.dir=/a b"'
#   HPCTRAIN_SITE  the site file (default ~/.config/hpctrain/site.sh, i.e.
#                  ${XDG_CONFIG_HOME:-$HOME/.config}/hpctrain/site.sh; jobs/site.example.sh
#                  is a commented example to copy there)
#   HPCTRAIN_ROOT  the hpctrain checkout (default: the one holding this file)
#   PYTHON         interpreter with hpctrain, mpi4py, h5py and torch (default: python3 on the
#                  PATH when it has them, an active venv, else $HPCTRAIN_ROOT/.venv/bin/python)
#   SRUN_MPI       srun's PMI plugin (default: pmix for Open MPI, pmi2 for the MPICH family,
#                  cray_shasta for Cray MPICH; `srun --mpi=list` shows the site's)
#   CPU_BIND       srun --cpu-bind value (default cores: each rank pinned to the cores of
#                  its --cpus-per-task); empty: leave binding to the site (and to clusters
#                  without a task/affinity plugin, where srun would warn)
#   DEVICE         cpu or cuda (default: cuda when the job has GPUs (--gpus-per-node), else
#                  cpu; cuda: one rank per GPU, see docs/slurm.md)

HPCTRAIN_ROOT=${HPCTRAIN_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
HPCTRAIN_SITE=${HPCTRAIN_SITE:-${XDG_CONFIG_HOME:-$HOME/.config}/hpctrain/site.sh}
# shellcheck source=site.example.sh
if [ -f "$HPCTRAIN_SITE" ]; then source "$HPCTRAIN_SITE"; fi

# -- 1. Modules and MPI ----------------------------------------------------------------
# Load the MPI that mpi4py and h5py were built against, and its parallel HDF5: the same
# modules as when `make setup` ran (docs/slurm.md has a row per family). Put them
# in the site file (`module load ...` or HPCTRAIN_MODULES). Examples; names differ by site:
#   Open MPI:    module load openmpi/4.1 hdf5/1.14-parallel python/3.11     (SRUN_MPI=pmix)
#   MPICH:       module load mpich/4.1 hdf5/1.14-parallel python/3.11       (SRUN_MPI=pmi2)
#   Cray MPICH:  module load PrgEnv-gnu cray-mpich cray-hdf5-parallel cray-python
#                                                                   (SRUN_MPI=cray_shasta)
#   Intel MPI:   module load intel-oneapi-mpi hdf5/parallel                  (SRUN_MPI=pmi2)
#   MVAPICH:     module load mvapich2-gdr/2.3.7 hdf5/parallel                (SRUN_MPI=pmi2)
#   GPUs:        module load cuda/12.4   (Cray: craype-accel-nvidia80 cudatoolkit)
if command -v module >/dev/null 2>&1 && [ -n "${HPCTRAIN_MODULES:-}" ]; then
  # shellcheck disable=SC2086
  module load $HPCTRAIN_MODULES
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}  # Lustre/GPFS: no flock
# Open MPI over srun needs nothing else; Intel MPI under srun wants SLURM's PMI library:
#   export I_MPI_PMI_LIBRARY=/usr/lib64/libpmi2.so ; SRUN_MPI=pmi2
# GPU-aware MPI (DEVICE=cuda; hpctrain's log line says which rule decided, docs/slurm.md):
#   Cray MPICH:  export MPICH_GPU_SUPPORT_ENABLED=1
#   MVAPICH:     export MV2_USE_CUDA=1
#   Intel MPI:   export I_MPI_OFFLOAD=1 HPCTRAIN_GPU_AWARE_MPI=1
#   any:         export HPCTRAIN_GPU_AWARE_MPI=0   (force host staging)

# -- 2. Shared plumbing (templates call these; sites need not edit) ---------------------
hpctrain_has_stack() {  # PYTHON: whether it finds hpctrain, mpi4py, h5py and torch
  "$1" -c 'import importlib.util as u, sys
sys.exit(not all(u.find_spec(m) for m in ("hpctrain", "mpi4py", "h5py", "torch")))' 2>/dev/null
}
if [ -z "${PYTHON:-}" ]; then
  if hpctrain_has_stack python3; then PYTHON=$(command -v python3)
  else PYTHON=$HPCTRAIN_ROOT/.venv/bin/python; fi
fi
hpctrain_pmi_default() {  # srun's PMI plugin for the MPI PYTHON's mpi4py is built with
  "$PYTHON" - 2>/dev/null <<'PY' || echo pmix
import mpi4py
mpi4py.rc.initialize = False  # MPI_Get_library_version may be called before MPI_Init
from mpi4py import MPI
from hpctrain.job.slurm import srun_pmi  # the rule the singleton refusal uses too
print(srun_pmi(MPI.Get_library_version()))
PY
}
SRUN_MPI=${SRUN_MPI:-$(hpctrain_pmi_default)}
CPU_BIND=${CPU_BIND-cores}
HPCTRAIN_GPUS=${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-0}}
HPCTRAIN_GPUS=${HPCTRAIN_GPUS##*:}  # "a100:4" -> 4
[[ "$HPCTRAIN_GPUS" =~ ^[0-9]+$ ]] || HPCTRAIN_GPUS=0
if [ "$HPCTRAIN_GPUS" -gt 0 ]; then DEVICE=${DEVICE:-cuda}; else DEVICE=${DEVICE:-cpu}; fi
HPCTRAIN_EXIT_REQUEUE=75  # hpctrain/job/slurm.py EXIT_REQUEUE: checkpointed, run me again

hpctrain_log() { echo "[job ${SLURM_JOB_ID:-?}] $*"; }

# hpctrain_run_dir NAME: where a run named NAME goes: RUN_DIR when set, else scratch
# ($SCRATCH/hpctrain-runs/NAME, else $HPCTRAIN_SCRATCH/hpctrain-runs/NAME from the site
# file), else runs/NAME in the submit directory, with a warning (home quotas are small).
hpctrain_run_dir() {
  if [ -n "${RUN_DIR:-}" ]; then
    echo "$RUN_DIR"
  elif [ -n "${SCRATCH:-}" ]; then
    echo "$SCRATCH/hpctrain-runs/$1"
  elif [ -n "${HPCTRAIN_SCRATCH:-}" ]; then
    echo "$HPCTRAIN_SCRATCH/hpctrain-runs/$1"
  else
    hpctrain_log "warning: neither SCRATCH nor HPCTRAIN_SCRATCH (site file) is set: the" \
                 "run goes to runs/$1 in $PWD; set RUN_DIR or" \
                 "HPCTRAIN_SCRATCH for a file system with room for checkpoints" >&2
    echo "runs/$1"
  fi
}

# hpctrain_resolve [CONFIG] [ARGS...]: sets CONFIG, RUN_NAME and HPCTRAIN_ARGS, hpctrain's
# arguments after the config: --set for each word of LAYOUT, each OVERRIDES item (split like
# a shell line: quotes keep spaces), model.device=$DEVICE, then ARGS unchanged (the last --set
# of a key wins) except `--run-dir DIR` (sets RUN_DIR) and `--run-name NAME` (RUN_NAME); then
# the layout's topology.dp when the config leaves it open (hpctrain.cli.batch layout, for
# HPCTRAIN_TASKS ranks, default SLURM_NTASKS). A layout that cannot fit exits 2.
hpctrain_resolve() {
  if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then CONFIG=$1; shift; fi
  CONFIG=${CONFIG:-$HPCTRAIN_ROOT/share/configs/demo.toml}
  local kv words fill
  words=$("$PYTHON" -c '
import shlex, sys
try:
    print("\n".join(shlex.split(sys.argv[1])))
except ValueError as e:
    sys.exit(f"OVERRIDES={sys.argv[1]!r}: {e}; quote each value that holds spaces, e.g. "
             "OVERRIDES=\x27train.steps=20 \"checkpoint.dir=/a b\"\x27")' "${OVERRIDES:-}") \
    || exit 2
  HPCTRAIN_ARGS=()
  for kv in ${LAYOUT:-}; do HPCTRAIN_ARGS+=(--set "$kv"); done
  while IFS= read -r kv; do
    if [ -n "$kv" ]; then HPCTRAIN_ARGS+=(--set "$kv"); fi
  done <<<"$words"
  HPCTRAIN_ARGS+=(--set "model.device=$DEVICE")
  while [ $# -gt 0 ]; do  # ARGS; --run-dir/--run-name set RUN_DIR/RUN_NAME
    case "$1" in
      --run-dir) RUN_DIR=${2:?--run-dir needs a directory}; shift ;;
      --run-dir=*) RUN_DIR=${1#*=} ;;
      --run-name) RUN_NAME=${2:?--run-name needs a name}; shift ;;
      --run-name=*) RUN_NAME=${1#*=} ;;
      *) HPCTRAIN_ARGS+=("$1") ;;
    esac
    shift
  done
  RUN_NAME=$("$PYTHON" -m hpctrain.cli.batch run-name "$CONFIG" --name "${RUN_NAME:-}") || exit 2
  fill=$("$PYTHON" -m hpctrain.cli.batch layout --tasks "${HPCTRAIN_TASKS:-$SLURM_NTASKS}" \
           "$CONFIG" "${HPCTRAIN_ARGS[@]}") || exit 2
  for kv in $fill; do HPCTRAIN_ARGS+=(--set "$kv"); done
  hpctrain_check_gpus
}

# hpctrain_check_gpus: on GPU jobs, warn about layouts that starve or share the GPUs.
hpctrain_check_gpus() {
  [ "$DEVICE" = cuda ] || return 0
  local per_node=${SLURM_NTASKS_PER_NODE%%(*}
  if [ "$HPCTRAIN_GPUS" -gt 0 ] && [ -n "$per_node" ] && [ "$per_node" != "$HPCTRAIN_GPUS" ]; then
    hpctrain_log "warning: $per_node tasks but $HPCTRAIN_GPUS GPUs per node: hpctrain runs" \
                 "one rank per GPU (--ntasks-per-node=$HPCTRAIN_GPUS)" >&2
  fi
  if [ "${SLURM_CPUS_PER_TASK:-1}" = 1 ]; then
    hpctrain_log "warning: one CPU core per GPU rank (data loading, Python and MPI progress" \
                 "share it): ask for more, e.g. sbatch --cpus-per-task=8" \
                 "(the node's cores / its GPUs)" >&2
  fi
}

# hpctrain_srun ARGS...: one rank per task, every task runs `python -m mpi4py -m hpctrain ARGS`
# (-m mpi4py: an exception on one rank aborts the job instead of hanging it).
# --kill-on-bad-exit: one failed rank ends the step (invariant: never hang silently).
# --export=ALL: the ranks see this script's environment (modules, OMP_NUM_THREADS) also where
# SBATCH_EXPORT=NONE would hand srun an empty one (SLURM_EXPORT_ENV=NONE).
HPCTRAIN_SRUN=(srun --export=ALL --mpi="$SRUN_MPI" --kill-on-bad-exit=1
               ${CPU_BIND:+--cpu-bind="$CPU_BIND"})
hpctrain_srun() {
  [ -z "${HPCTRAIN_DRY_RUN:-}" ] || hpctrain_dry_run "$@"
  "${HPCTRAIN_SRUN[@]}" "$PYTHON" -m mpi4py -m hpctrain "$@"
}

# hpctrain_dry_run train CONFIG --run-dir DIR ARGS...: what jobs/dry-run.sh runs in place of
# the job step (HPCTRAIN_DRY_RUN=1): says what the job resolved, runs the checks the step's
# `hpctrain train` would make at start (hpctrain.cli.batch preflight), then `hpctrain plan`
# (PLAN_ARGS); exits with their status. The template itself runs up to here unchanged.
hpctrain_dry_run() {
  shift 2  # train CONFIG
  hpctrain_log "account ${SBATCH_ACCOUNT:-(site default)}, partition" \
               "${SBATCH_PARTITION:-(site default)}, modules ${HPCTRAIN_MODULES:-(none)}"
  hpctrain_log "$SLURM_NTASKS tasks on $SLURM_JOB_NUM_NODES node(s), device $DEVICE," \
               "run $RUN_NAME: $CONFIG"
  local sets=() plan_args i args=("$@")
  for ((i = 0; i < ${#args[@]}; i++)); do
    if [ "${args[i]}" = --set ]; then sets+=(--set "${args[i + 1]}"); ((i += 1)); fi
  done
  "$PYTHON" -m hpctrain.cli.batch preflight --tasks "${HPCTRAIN_TASKS:-$SLURM_NTASKS}" \
    "$CONFIG" "$@" || exit $?
  read -r -a plan_args <<<"${PLAN_ARGS:-}"
  "$PYTHON" -m hpctrain plan "$CONFIG" --world-size "${HPCTRAIN_TASKS:-$SLURM_NTASKS}" \
    --nodes "$SLURM_JOB_NUM_NODES" --ranks-per-node "${SLURM_NTASKS_PER_NODE%%(*}" \
    "${plan_args[@]}" "${sets[@]}"
  exit $?
}

# hpctrain_srun_forwarding ARGS...: hpctrain_srun in the background with SIGUSR1/SIGTERM sent
# to the batch shell (--signal=B:USR1@SECS, scancel --batch) forwarded to srun, which hands
# them to every rank. Sets HPCTRAIN_RC to srun's exit status.
hpctrain_forward() {  # SIGNAL: pass it on to srun (trap handler)
  hpctrain_log "SIG$1: forwarded to the ranks"
  [ -n "${HPCTRAIN_SRUN_PID:-}" ] && kill -"$1" "$HPCTRAIN_SRUN_PID" 2>/dev/null || true
}
hpctrain_run_forwarding() {  # COMMAND...: in the background, signals forwarded; HPCTRAIN_RC
  HPCTRAIN_SRUN_PID=
  trap 'hpctrain_forward USR1' USR1
  trap 'hpctrain_forward TERM' TERM
  # the command itself in the background (not a subshell: that would die of the signal).
  "$@" &
  HPCTRAIN_SRUN_PID=$!
  # wait returns early (status > 128) when a trapped signal arrives: wait again while srun
  # runs; bash keeps the exit status of a finished child, so the last wait reads it.
  while kill -0 "$HPCTRAIN_SRUN_PID" 2>/dev/null; do wait "$HPCTRAIN_SRUN_PID" || true; done
  wait "$HPCTRAIN_SRUN_PID" && HPCTRAIN_RC=0 || HPCTRAIN_RC=$?
  trap - USR1 TERM
}
hpctrain_srun_forwarding() {
  [ -z "${HPCTRAIN_DRY_RUN:-}" ] || hpctrain_dry_run "$@"
  hpctrain_run_forwarding "${HPCTRAIN_SRUN[@]}" "$PYTHON" -m mpi4py -m hpctrain "$@"
}

# hpctrain_srun_relaunching ARGS...: hpctrain_srun_forwarding through `hpctrain launch
# --relaunch` (hpctrain/job/relaunch.py, docs/slurm.md): when the step fails, probe the job's
# nodes with `srun -N1 true`, drop those that fail, use spare nodes, re-plan the layout for
# the ranks left (`hpctrain plan --emit-overrides`), resume from the freshest checkpoint, up
# to HPCTRAIN_RELAUNCHES times (default 2); then HPCTRAIN_RC=75 (requeue). Variables:
#   HPCTRAIN_RELAUNCHES    relaunches inside the job before the requeue (default 2)
#   HPCTRAIN_SPARE_NODES   nodes of the job held back to replace failed ones (default 0)
#   HPCTRAIN_PROBE_TIMEOUT seconds a node may take to run `srun -N1 true` (default 30)
#   HPCTRAIN_PLAN_CLUSTER  cluster description the re-plan ranks layouts on (plan --cluster)
hpctrain_srun_relaunching() {
  [ -z "${HPCTRAIN_DRY_RUN:-}" ] || hpctrain_dry_run "$@"
  hpctrain_run_forwarding "$PYTHON" -m hpctrain launch \
    --relaunch "${HPCTRAIN_RELAUNCHES:-2}" --spare "${HPCTRAIN_SPARE_NODES:-0}" \
    --probe-timeout "${HPCTRAIN_PROBE_TIMEOUT:-30}" --program "${HPCTRAIN_SRUN[*]}" \
    ${HPCTRAIN_PLAN_CLUSTER:+--cluster "$HPCTRAIN_PLAN_CLUSTER"} \
    -- "$PYTHON" -m mpi4py -m hpctrain "$@"
}

# hpctrain_requeue_or_exit: turn the trainer's exit status into the job's fate.
hpctrain_requeue_or_exit() {
  if [ "$HPCTRAIN_RC" = "$HPCTRAIN_EXIT_REQUEUE" ]; then
    hpctrain_log "checkpoint written; requeueing (restart count ${SLURM_RESTART_COUNT:-0})"
    if ! scontrol requeue "$SLURM_JOB_ID"; then
      hpctrain_log "scontrol requeue failed (submitted without --requeue?); resubmit by hand"
      exit "$HPCTRAIN_EXIT_REQUEUE"
    fi
    exit 0
  fi
  exit "$HPCTRAIN_RC"
}
