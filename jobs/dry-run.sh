#!/usr/bin/env bash
# Dry run on the login node: `hpctrain plan` for the job an sbatch line would start, with
# the config that job would resolve (jobs/env.sh: CONFIG, LAYOUT, OVERRIDES, DEVICE, the
# arguments, jobs/site.sh), without submitting anything. Replace `sbatch` by this script:
#     jobs/dry-run.sh --nodes=2 --ntasks-per-node=4 jobs/multi-node.sbatch \
#         share/configs/demo.toml --set topology.tp=2 --set topology.dp=4
#     LAYOUT="topology.tp=2 topology.dp=2" jobs/dry-run.sh jobs/single-node.sbatch
# Nodes, tasks per node and GPUs per node come from the options (--nodes/-N,
# --ntasks-per-node, --ntasks/-n, --gpus-per-node, --cpus-per-task, --export=ALL,K=V,...),
# else from the template's #SBATCH lines; other sbatch options are ignored. PLAN_ARGS: more
# `hpctrain plan` options, e.g. PLAN_ARGS="--cluster dgx-a100" (the predicted step time) or
# "--memory-per-rank 80GB". Only the --set arguments reach the plan (train options do not).
# A plain script, not a job: the plan needs no MPI and no compute node, takes seconds, and a
# job would wait in the queue for an allocation it does not use.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
die() { echo "jobs/dry-run.sh: $*" >&2; exit 2; }

nodes='' per_node='' ntasks='' gpus='' template=''
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
    --export=*)  # ALL,K=V,... : the variables the job would see (NONE: none added)
      IFS=, read -r -a pairs <<<"${1#*=}"
      for kv in "${pairs[@]}"; do
        case "$kv" in *=*) export "${kv%%=*}=${kv#*=}" ;; esac
      done ;;
    -*) ;;  # other sbatch options: no effect on the plan
    *) template=$1 ;;
  esac
  shift
done
usage="jobs/dry-run.sh [SBATCH OPTIONS] jobs/T.sbatch [CONFIG] [ARGS]"
[ -n "$template" ] || die "no template: usage: $usage"
[ -f "$template" ] || die "$template: no such template (run from the checkout: jobs/*.sbatch)"
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

export SLURM_JOB_NUM_NODES=$nodes SLURM_NTASKS_PER_NODE=$per_node
export SLURM_NTASKS=${ntasks:-$((nodes * per_node))} SLURM_GPUS_PER_NODE=${gpus:-0}
export HPCTRAIN_ROOT=${HPCTRAIN_ROOT:-$(dirname "$here")} SRUN_MPI=${SRUN_MPI:-none}
# shellcheck source=env.sh
source "$here/env.sh"
hpctrain_resolve "$@"
sets=()
for ((i = 0; i < ${#HPCTRAIN_ARGS[@]}; i++)); do
  if [ "${HPCTRAIN_ARGS[i]}" = --set ]; then sets+=(--set "${HPCTRAIN_ARGS[i + 1]}"); ((i += 1)); fi
done
read -r -a plan_args <<<"${PLAN_ARGS:-}"
hpctrain_log "plan for $SLURM_NTASKS ranks on $nodes node(s), device $DEVICE: $CONFIG"
exec "$PYTHON" -m hpctrain plan "$CONFIG" --world-size "$SLURM_NTASKS" --nodes "$nodes" \
  --ranks-per-node "$per_node" "${plan_args[@]}" "${sets[@]}"
