#!/usr/bin/env bash
# A storage cluster of N nodes and a compute tier, in network namespaces (docs/SCALING.md):
#
#   tgc-fabric   bridge tgc-br 10.78.0.1/24: the storage back-plane (unshaped), where the SeaweedFS
#                master and the filer + S3 run
#   tgc-node$i   10.78.0.(10+i) on the back-plane (a volume server and a gateway run here), and
#                10.79.$i.1 on its own link to the compute tier, shaped with tc tbf at RATE both ways
#   tgc-compute  10.79.$i.2 on each node's link (the training client runs here), with a route to each
#                node's back-plane address over that node's link: a member has one address, which
#                clients reach over its link and the other members (probes, hops) over the back-plane
#
#   topology.sh up N RATE_MBIT   create (replacing any previous one), N in 1..8
#   topology.sh down             remove everything (idempotent)
#   topology.sh check            exit 0 if this machine can build it (root, ip, tc)
#
# Needs root (namespaces and qdiscs are privileged) and refuses without it. All traffic stays in the
# namespaces this script creates. tbf's burst is rate x 5 ms (at least 32 KiB), as in bench/repro.
set -euo pipefail
F=tgc-fabric C=tgc-compute BR=tgc-br

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "topology.sh: needs root to create network namespaces and tc qdiscs" >&2
    exit 2
  fi
  command -v ip >/dev/null && command -v tc >/dev/null || { echo "topology.sh: needs ip and tc (iproute2)" >&2; exit 2; }
}

down() {
  for ns in $(ip netns list | awk '{print $1}' | grep -E '^tgc-' || true); do ip netns del "$ns" 2>/dev/null || true; done
}

shape() {  # ns dev rate
  local burst=$(( $3 * 1000000 / 8 / 200 ))
  [ "$burst" -lt 32768 ] && burst=32768
  ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "${3}mbit" burst "$burst" latency 50ms
}

case "${1:-}" in
  up)
    need_root
    n=${2:?number of nodes} rate=${3:?rate in Mbit/s}
    [ "$n" -ge 1 ] && [ "$n" -le 8 ] || { echo "topology.sh: N in 1..8" >&2; exit 64; }
    down
    ip netns add "$F"
    ip netns add "$C"
    ip -n "$F" link add "$BR" type bridge
    ip -n "$F" addr add 10.78.0.1/24 dev "$BR"
    ip -n "$F" link set "$BR" up
    for i in $(seq 1 "$n"); do
      node=tgc-node$i
      ip netns add "$node"
      # back-plane: node <-> fabric bridge
      ip link add "tgc-b$i" netns "$node" type veth peer name "tgc-bp$i" netns "$F"
      ip -n "$F" link set "tgc-bp$i" master "$BR" up
      ip -n "$node" addr add "10.78.0.$((10 + i))/24" dev "tgc-b$i"
      ip -n "$node" link set "tgc-b$i" up
      # the node's own shaped link to the compute tier
      ip link add "tgc-n$i" netns "$node" type veth peer name "tgc-c$i" netns "$C"
      ip -n "$node" addr add "10.79.$i.1/24" dev "tgc-n$i"
      ip -n "$C" addr add "10.79.$i.2/24" dev "tgc-c$i"
      ip -n "$node" link set "tgc-n$i" up
      ip -n "$C" link set "tgc-c$i" up
      ip -n "$C" route add "10.78.0.$((10 + i))/32" via "10.79.$i.1"
      shape "$node" "tgc-n$i" "$rate"
      shape "$C" "tgc-c$i" "$rate"
    done
    for ns in "$F" "$C" $(seq -f 'tgc-node%g' 1 "$n"); do ip -n "$ns" link set lo up; done
    ;;
  down) need_root; down ;;
  check)
    need_root
    ip netns add tgc-probe && ip netns del tgc-probe
    ;;
  *) sed -n '2,16p' "$0"; exit 64 ;;
esac
