#!/usr/bin/env bash
# A small cluster of "nodes" on one machine, for multi-node tests and benchmarks.
#
#   scripts/cluster.sh up NAME NODES [SLOTS [RATE]]  make it: SLOTS ranks per node (default 2)
#                                             fill a node before the next; RATE e.g. 1gbit
#   scripts/cluster.sh shape NAME RATE|off    shape (or unshape) every node's link
#   scripts/cluster.sh mpirun NAME ARGS...    Open MPI's mpirun over the nodes (hostfile, agent, TCP)
#   scripts/cluster.sh mpiexec NAME ARGS...   Hydra's mpiexec (MPICH family; $MPIEXEC, default
#                                             mpiexec.mpich) over the nodes, the same way
#   scripts/cluster.sh down NAME              remove everything `up` made (alias: cleanup)
#   scripts/cluster.sh lose NAME I            node I lost: its processes killed, its namespace gone
#   scripts/cluster.sh heal NAME              the lost nodes back (new namespaces, unshaped links)
#   scripts/cluster.sh check                  exit 0 when namespaces can be made here
#   scripts/cluster.sh with NAME NODES SLOTS RATE -- CMD...   up, run CMD, down (always)
#
# Each node is a network namespace hpct-NAME-nI with one interface eth0 (10.213.0.I+1/24)
# whose peer sits on a bridge br0 inside a hub namespace hpct-NAME-hub (10.213.0.254).
# Nothing is created in the caller's namespace: every address and link lives inside the
# namespaces made here, so no traffic can leave them. mpirun runs in the hub namespace and
# starts one orted per node through scripts/cluster_agent.sh, which enters the node's
# namespace and a fresh UTS namespace whose hostname is the node's name (so Open MPI sees
# distinct nodes: shared memory within a node, TCP between nodes; Hydra's proxies come up
# the same way through its rsh launcher, and `-iface br0` gives them the hub's address). A
# link is shaped with a
# token bucket (tc tbf) on both of its ends; the kernel here has no netem, so no delay.
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NET=10.213.0

usage() { sed -n '3,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }
die() { echo "cluster.sh: $*" >&2; exit 1; }
valid_name() { [[ "$1" =~ ^[a-z0-9]{1,8}$ ]] || die "NAME must be 1-8 of [a-z0-9], got '$1'"; }
state() { echo "/tmp/hpct-cluster-$1"; }
nodes_of() { ip netns list | awk '{print $1}' | grep -E "^hpct-$1-n[0-9]+$" | sort -V || true; }

check() {
  command -v ip >/dev/null || die "iproute2 (ip) is missing: apt-get install iproute2"
  command -v tc >/dev/null || die "tc is missing: apt-get install iproute2"
  command -v unshare >/dev/null || die "unshare is missing (util-linux)"
  local probe="hpct-probe-$$"
  ip netns add "$probe" 2>/dev/null || die "cannot create network namespaces (needs root)"
  ip -n "$probe" link add br0 type bridge 2>/dev/null || { ip netns del "$probe"; \
    die "cannot create a bridge inside a namespace"; }
  unshare --uts true 2>/dev/null || { ip netns del "$probe"; die "cannot unshare UTS"; }
  ip netns del "$probe"
}

shape() {  # shape NAME RATE|off: token bucket on both ends of every node link
  local name=$1 rate=$2 i=0
  for ns in $(nodes_of "$name"); do
    for dev in "$ns eth0" "hpct-$name-hub v$i"; do
      set -- $dev
      if [[ "$rate" == off ]]; then
        ip -n "$1" link set "$2" up
        tc -n "$1" qdisc del dev "$2" root 2>/dev/null || true
      else  # burst above the 64 KiB GSO segments of a veth, else tbf drops them all
        tc -n "$1" qdisc replace dev "$2" root tbf rate "$rate" burst 256kb latency 100ms
      fi
    done
    i=$((i + 1))
  done
}

mac() {  # mac I: the fixed address of node I's eth0 (I = 254: the hub's bridge)
  printf '02:00:0a:d5:00:%02x' "$(( $1 == 254 ? 254 : $1 + 1 ))"
}

add_node() {  # add_node NAME I: node I's namespace, its link to the hub's bridge. Fixed
  # addresses: a healed node keeps its MAC, and the bridge keeps its own (a bridge without
  # one takes its lowest port's, so a new port would change the hub's MAC under the other
  # nodes' ARP caches and their connections to the hub would stall for a minute)
  local name=$1 i=$2 ns="hpct-$1-n$2" hub="hpct-$1-hub"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip -n "$hub" link add "v$i" type veth peer name eth0 address "$(mac "$i")" netns "$ns"
  ip -n "$hub" link set "v$i" master br0 up
  ip -n "$ns" addr add "$NET.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
}

lose() {  # lose NAME I: every process of node I killed (their connections close as when a
  # node's ranks die), then the node gone, so a probe of it fails at once
  local ns="hpct-$1-n$2" pids t=0
  existing "$1" >/dev/null
  ip netns list | awk '{print $1}' | grep -qx "$ns" || die "no node $ns"
  pids=$(ip netns pids "$ns")
  [[ -z "$pids" ]] || kill -9 $pids 2>/dev/null || true
  while [[ -n "$(ip netns pids "$ns")" && $t -lt 300 ]]; do sleep 0.1; t=$((t + 1)); done
  sleep 0.5  # the closing packets leave before the node's link goes
  ip netns del "$ns"
}

heal() {  # heal NAME: every node of the hostfile that is gone made again
  local name=$1 dir i=0
  dir=$(existing "$name")
  while read -r ns _; do
    ip netns list | awk '{print $1}' | grep -qx "$ns" || add_node "$name" "$i"
    i=$((i + 1))
  done < "$dir/hostfile"
}

up() {
  local name=$1 n=$2 slots=${3:-2} rate=${4:-off}
  valid_name "$name"
  [[ "$n" =~ ^[0-9]+$ && "$n" -ge 1 && "$n" -le 16 ]] || die "NODES must be 1..16"
  [[ "$slots" =~ ^[0-9]+$ && "$slots" -ge 1 ]] || die "SLOTS must be >= 1"
  [[ -z "$(nodes_of "$name")" ]] || die "cluster $name exists: cluster.sh down $name first"
  check
  trap "echo 'cluster.sh: up failed, removing cluster $name' >&2; down $name" ERR
  local hub="hpct-$name-hub" dir
  dir=$(state "$name")
  mkdir -p "$dir"
  ip netns add "$hub"
  ip -n "$hub" link set lo up
  ip -n "$hub" link add br0 address "$(mac 254)" type bridge
  ip -n "$hub" addr add "$NET.254/24" dev br0
  ip -n "$hub" link set br0 up
  : > "$dir/hostfile"
  for ((i = 0; i < n; i++)); do
    add_node "$name" "$i"
    echo "hpct-$name-n$i slots=$slots" >> "$dir/hostfile"
  done
  shape "$name" "$rate"
  trap - ERR
  echo "$dir"
}

with_cluster() {  # with NAME NODES SLOTS RATE -- CMD...: up, run CMD, always down
  local name=$1 n=$2 slots=$3 rate=$4
  shift 4
  [[ "${1:-}" == -- ]] && shift
  up "$name" "$n" "$slots" "$rate" >/dev/null
  trap "down $name" EXIT INT TERM  # NAME is [a-z0-9] only
  "$@"
}

down() {  # the processes left in the nodes (a failed test's ranks) are killed first
  local name=$1 pids
  valid_name "$name"
  for ns in $(nodes_of "$name"); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -z "$pids" ]] || kill -9 $pids 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  ip netns del "hpct-$name-hub" 2>/dev/null || true  # its veth ends and bridge go with it
  rm -rf "$(state "$name")"
}

existing() {  # NAME -> the state directory of that cluster (dies when there is none)
  valid_name "$1"
  local dir
  dir=$(state "$1")
  [[ -f "$dir/hostfile" ]] || die "no cluster $1: cluster.sh up $1 N first"
  echo "$dir"
}

run_mpirun() {  # mpirun NAME ARGS...: in the hub namespace, over the nodes' hostfile
  local name=$1 dir
  shift
  dir=$(existing "$name")
  exec ip netns exec "hpct-$name-hub" mpirun --hostfile "$dir/hostfile" \
    --mca plm_rsh_agent "$HERE/cluster_agent.sh" --mca plm_rsh_no_tree_spawn 1 \
    --mca btl tcp,vader,self --mca btl_tcp_if_include "$NET.0/24" \
    --mca oob_tcp_if_include "$NET.0/24" "$@"
}

run_mpiexec() {  # mpiexec NAME ARGS...: Hydra in the hub namespace, over host:slots lines
  local name=$1 dir
  shift
  dir=$(existing "$name")
  sed 's/ slots=/:/' "$dir/hostfile" > "$dir/hosts.hydra"
  exec ip netns exec "hpct-$name-hub" "${MPIEXEC:-mpiexec.mpich}" -f "$dir/hosts.hydra" \
    -launcher rsh -launcher-exec "$HERE/cluster_agent.sh" -iface br0 "$@"
}

cmd=${1:-}
shift || true
case "$cmd" in
  up) [[ $# -ge 2 ]] || usage; up "$@" ;;
  down | cleanup) [[ $# -eq 1 ]] || usage; down "$1" ;;
  shape) [[ $# -eq 2 ]] || usage; valid_name "$1"; shape "$1" "$2" ;;
  mpirun) [[ $# -ge 1 ]] || usage; run_mpirun "$@" ;;
  mpiexec) [[ $# -ge 1 ]] || usage; run_mpiexec "$@" ;;
  with) [[ $# -ge 6 ]] || usage; with_cluster "$@" ;;
  lose) [[ $# -eq 2 ]] || usage; lose "$1" "$2" ;;
  heal) [[ $# -eq 1 ]] || usage; heal "$1" ;;
  check) check ;;
  *) usage ;;
esac
