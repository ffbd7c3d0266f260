#!/usr/bin/env bash
# Two network namespaces joined by a rate-limited veth pair (HAPI's storage and compute tiers):
#   tg-storage (10.77.0.1)  <== veth, tc tbf RATE both ways ==>  tg-compute (10.77.0.2)
#
#   topology.sh up RATE_MBIT     create (replacing any previous one); RATE may be changed by rerunning
#   topology.sh rate RATE_MBIT   change the rate in place
#   topology.sh down             remove everything (idempotent)
#   topology.sh check            exit 0 if this machine can build it (root, ip, tc, tbf)
#   topology.sh measure          after `up`: Mbit/s of a 20 MB HTTP transfer storage -> compute
#
# Needs root (namespaces and qdiscs are privileged) and refuses without it. netem is not available
# on this kernel, so no latency or loss is added; tbf's burst is rate x 5 ms (at least 32 KiB).
set -euo pipefail
S=tg-storage C=tg-compute VS=tg-veth-s VC=tg-veth-c
S_IP=10.77.0.1 C_IP=10.77.0.2

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "topology.sh: needs root to create network namespaces and tc qdiscs (run as root, or use the smoke mode)" >&2
    exit 2
  fi
  command -v ip >/dev/null && command -v tc >/dev/null || { echo "topology.sh: needs ip and tc (iproute2)" >&2; exit 2; }
}

shape() {
  local rate=$1 burst
  burst=$(( rate * 1000000 / 8 / 200 ))
  [ "$burst" -lt 32768 ] && burst=32768
  ip netns exec "$S" tc qdisc replace dev "$VS" root tbf rate "${rate}mbit" burst "$burst" latency 50ms
  ip netns exec "$C" tc qdisc replace dev "$VC" root tbf rate "${rate}mbit" burst "$burst" latency 50ms
}

down() {
  ip netns del "$S" 2>/dev/null || true
  ip netns del "$C" 2>/dev/null || true
}

case "${1:-}" in
  up)
    need_root
    rate=${2:?rate in Mbit/s}
    down
    ip netns add "$S"
    ip netns add "$C"
    ip link add "$VS" type veth peer name "$VC"
    ip link set "$VS" netns "$S"
    ip link set "$VC" netns "$C"
    ip -n "$S" addr add "$S_IP/30" dev "$VS"
    ip -n "$C" addr add "$C_IP/30" dev "$VC"
    for ns in "$S" "$C"; do ip -n "$ns" link set lo up; done
    ip -n "$S" link set "$VS" up
    ip -n "$C" link set "$VC" up
    shape "$rate"
    ;;
  rate) need_root; shape "${2:?rate in Mbit/s}" ;;
  down) need_root; down ;;
  check)
    need_root
    ip netns add tg-probe && ip netns del tg-probe
    ;;
  measure)
    need_root
    dir=$(mktemp -d)
    head -c 20000000 /dev/urandom > "$dir/blob"
    ip netns exec "$S" python3 -m http.server 8089 --bind "$S_IP" --directory "$dir" >/dev/null 2>&1 &
    server=$!
    trap 'kill $server 2>/dev/null; rm -rf "$dir"' EXIT
    sleep 1
    ip netns exec "$C" python3 -c "
import time, urllib.request
t = time.time(); n = len(urllib.request.urlopen('http://$S_IP:8089/blob').read())
print(f'{n * 8 / (time.time() - t) / 1e6:.2f} Mbit/s')"
    ;;
  *) sed -n '2,13p' "$0"; exit 64 ;;
esac
