#!/usr/bin/env bash
# A real, single-host SLURM for tests and trying the jobs/ templates: Debian's slurm-wlm and
# munge, one controller and one compute node (this host), everything as root.
#
#   scripts/slurm.sh start    install what is missing (apt, root), start munged, slurmctld
#                             and slurmd, wait until the node is idle. Idempotent: a running
#                             cluster is left alone.
#   scripts/slurm.sh stop     stop the daemons this script started and forget their state.
#   scripts/slurm.sh status   sinfo, or exit 1 when the cluster is not up.
#
# Overridable: SLURM_CPUS (CPUs the node advertises, default 16: tasks oversubscribe the
# real cores, as the local launcher does (hpctrain/job/launch.py), so the tests' jobs all run at once), SLURM_STATE (daemon state/logs, default
# /var/lib/hpctrain-slurm). The config goes to /etc/slurm/slurm.conf (where the clients look);
# a slurm.conf that this script did not write is never overwritten.
#
# Choices that make SLURM work in a container: SlurmdParameters=config_overrides (advertise
# CPUs the host does not have), ProctrackType=proctrack/linuxproc and TaskPlugin=task/none
# (no cgroups), no accounting. MpiDefault is pmix when Debian's plugin is present (it is in
# slurm-wlm-basic-plugins, built against PMIx 4), else none.
set -euo pipefail
CPUS=${SLURM_CPUS:-16}
STATE=${SLURM_STATE:-/var/lib/hpctrain-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by hpctrain scripts/slurm.sh"
HOST=$(hostname -s)
say() { echo "[slurm] $*"; }
die() { echo "[slurm] error: $*" >&2; exit 1; }

install() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
     && command -v sbatch >/dev/null && command -v munged >/dev/null; then
    return
  fi
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
    || die "slurm-wlm and munge are missing and apt-get as root is not available"
  say "installing slurm-wlm and munge with apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge >/dev/null
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    return
  fi
  mkdir -p /etc/munge /var/lib/munge /var/log/munge /run/munge
  if [ ! -s /etc/munge/munge.key ]; then
    say "creating a munge key"
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown -R munge:munge /etc/munge /var/lib/munge /var/log/munge /run/munge 2>/dev/null || true
  chmod 0400 /etc/munge/munge.key
  chmod 0700 /etc/munge
  # As the munge user when it exists (munged's preference), else --force as root.
  if id munge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged
  else
    /usr/sbin/munged --force
  fi
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  die "munged did not start"
}

mpi_default() {
  local dir
  dir=$(dirname "$(find /usr/lib -name 'mpi_none.so' -path '*slurm*' 2>/dev/null | head -1)")
  if ls "$dir"/mpi_pmix*.so >/dev/null 2>&1; then echo pmix; else echo none; fi
}

write_conf() {
  if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; not touching it"
  fi
  mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$STATE/log"
  local tmp="$CONF.tmp"
  cat >"$tmp" <<EOF
$MARK ($(date -u +%FT%TZ)); scripts/slurm.sh stop removes it.
ClusterName=hpctrain
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=10  # a requeued job may start 10 s later (default 120)
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2  # fast turnaround for tests
MpiDefault=$(mpi_default)
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
  mv "$tmp" "$CONF"
}

node_state() { sinfo -h -N -n "$HOST" -o '%T' 2>/dev/null | head -1; }

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  install
  start_munge
  if running "$STATE/slurmctld.pid" && running "$STATE/slurmd.pid" \
     && [[ "$(node_state)" =~ ^(idle|mixed|allocated) ]]; then
    say "already up: node $HOST $(node_state)"
    return
  fi
  write_conf
  running "$STATE/slurmctld.pid" || /usr/sbin/slurmctld -i
  running "$STATE/slurmd.pid" || /usr/sbin/slurmd
  for _ in $(seq 120); do
    case "$(node_state)" in
      idle*|mixed*|allocated*) say "up: node $HOST $(node_state), MpiDefault=$(mpi_default)"
                               return ;;
      down*|drain*) scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  tail -n 20 "$STATE"/log/*.log >&2 || true
  die "node $HOST did not become idle (logs above, in $STATE/log)"
}

stop_pidfile() {
  local f=$1
  running "$f" || return 0
  local pid
  pid=$(cat "$f")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
  kill -9 "$pid" 2>/dev/null || true
}

stop() {
  if running "$STATE/slurmctld.pid"; then
    scancel --full --quiet --state=running,pending -u "$(id -un)" 2>/dev/null || true
  fi
  stop_pidfile "$STATE/slurmd.pid"
  stop_pidfile "$STATE/slurmctld.pid"
  rm -rf "$STATE"
  if [ -f "$CONF" ] && grep -qF "$MARK" "$CONF"; then rm -f "$CONF"; fi
  say "stopped"
  # munged is left running: it is harmless, shared, and cheap to keep.
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) sinfo && [ -n "$(node_state)" ] ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
