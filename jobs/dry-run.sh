#!/usr/bin/env bash
# Dry run on the login node: runs the template an sbatch line names, as the job would (the
# site file, jobs/env.sh, CONFIG, RUN_NAME, LAYOUT, OVERRIDES, DEVICE, the arguments), up to
# the job step; in its place it prints what the job resolved (account, partition, modules,
# layout, run directory and whether the run is new or continues), runs every check
# `hpctrain train` makes at start (config, layout against the tasks, data and tokenizer,
# directories, the checkpoint to resume) and `hpctrain plan`. Nothing is submitted or
# written; exit 2 when the job would be refused. Replace `sbatch` by this script:
#     jobs/dry-run.sh --nodes=4 --ntasks-per-node=8 jobs/multi-node.sbatch \
#         share/configs/llama3-8b.toml
#     LAYOUT="topology.tp=2 topology.dp=2" jobs/dry-run.sh jobs/single-node.sbatch
# `hpctrain submit` runs this, then sbatch with the same line when it passes.
# Nodes, tasks per node and GPUs per node come from the options (--nodes/-N,
# --ntasks-per-node, --ntasks/-n, --gpus-per-node, --cpus-per-task, --account/-A,
# --partition/-p, --job-name/-J, --array, --export=ALL,K=V,...), else from the template's
# #SBATCH lines; other sbatch options are ignored. PLAN_ARGS: more `hpctrain plan` options,
# e.g. PLAN_ARGS="--cluster dgx-a100" (the predicted step time).
set -euo pipefail
die() { echo "jobs/dry-run.sh: $*" >&2; exit 2; }

nodes='' per_node='' ntasks='' gpus='' template='' name='' array=''
while [ $# -gt 0 ] && [ -z "$template" ]; do
  case "$1" in
    --nodes=*) nodes=${1#*=} ;;
    -N) nodes=$2; shift ;;
    -N*) nodes=${1#-N} ;;
    --ntasks-per-node=*) per_node=${1#*=} ;;
    --ntasks=*) ntasks=${1#*=} ;;
    -n) ntasks=$2; shift ;;
    -n*) ntasks=${1#-n} ;;
    --gpus-per-node=*) gpus=${1#*=} ;;
    --cpus-per-task=*) export SLURM_CPUS_PER_TASK=${1#*=} ;;
    --account=*) export SBATCH_ACCOUNT=${1#*=} ;;
    -A) export SBATCH_ACCOUNT=$2; shift ;;
    --partition=*) export SBATCH_PARTITION=${1#*=} ;;
    -p) export SBATCH_PARTITION=$2; shift ;;
    --job-name=*) name=${1#*=} ;;
    -J) name=$2; shift ;;
    --array=*) array=${1#*=} ;;
    --export=*)  # ALL,K=V,... : the variables the job would see (NONE: none added)
      IFS=, read -r -a pairs <<<"${1#*=}"
      for kv in "${pairs[@]}"; do
        case "$kv" in *=*) export "${kv%%=*}=${kv#*=}" ;; esac
      done ;;
    -*) ;;  # other sbatch options: no effect on the job's resolution
    *) template=$1 ;;
  esac
  shift
done
usage="jobs/dry-run.sh [SBATCH OPTIONS] jobs/T.sbatch [CONFIG] [ARGS]"
[ -n "$template" ] || die "no template: usage: $usage"
[ -f "$template" ] || die "$template: no such template (the templates are in jobs/ of hpctrain)"
directive() {  # the template's #SBATCH --NAME=VALUE, or empty
  sed -n "s/^#SBATCH --$1=\([^ ]*\).*/\1/p" "$template" | head -1
}
nodes=${nodes:-$(directive nodes)}
nodes=${nodes%%-*}  # --nodes=2-4: the plan is for the minimum
nodes=${nodes:-1}
per_node=${per_node:-$(directive ntasks-per-node)}
if [ -z "$per_node" ]; then per_node=$(( ${ntasks:-1} / nodes )); fi
gpus=${gpus:-$(directive gpus-per-node)}
cpus=$(directive cpus-per-task)
export SLURM_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-${cpus:-1}}
for v in nodes per_node; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || die "$v=${!v}: expected a positive integer"
done
array=${array:-$(directive array)}
first=${array%%[-,:%]*}  # the array's first element stands for the others

export SLURM_JOB_NUM_NODES=$nodes SLURM_NTASKS_PER_NODE=$per_node
export SLURM_NTASKS=${ntasks:-$((nodes * per_node))} SLURM_GPUS_PER_NODE=${gpus:-0}
export SLURM_JOB_NAME=${name:-$(directive job-name)} SLURM_JOB_ID=dry-run
export SLURM_JOB_NODELIST=dry-run SLURM_SUBMIT_DIR=$PWD SRUN_MPI=${SRUN_MPI:-none}
export HPCTRAIN_DRY_RUN=1
if [ -n "$array" ]; then export SLURM_ARRAY_TASK_ID=$first SLURM_ARRAY_JOB_ID=dry-run; fi
exec bash "$template" "$@"
