#!/bin/sh
# Open MPI's rsh agent and Hydra's rsh launcher for scripts/cluster.sh:
# `cluster_agent.sh HOST COMMAND...` runs the command (an orted, a hydra_pmi_proxy) inside
# node HOST's network namespace and in a fresh UTS namespace whose hostname is HOST. Only the namespaces cluster.sh makes (hpct-NAME-nI) are accepted.
host=$1
shift
case "$host" in
  hpct-*-n[0-9]*) ;;
  *) echo "cluster_agent.sh: not a cluster node: $host" >&2; exit 1 ;;
esac
exec ip netns exec "$host" unshare --uts -- /bin/sh -c 'hostname "$0" && exec /bin/sh -c "$1"' \
  "$host" "$*"
