#!/usr/bin/env bash
# The gateway's CPU per small request, two builds against each other: both run in transparent
# mode beside one SeaweedFS, each pinned to the last core while the store and the client share the
# others, and `s3bench ... latency` (1,500 PUTs and 1,500 GETs of 4 KiB, 16 at once, then 1,000
# sequential GETs and 3,000 with 32 at once: 7,000 requests) runs against A, then B, ROUNDS times.
# Each gateway's user + system CPU over its run comes from /proc/PID/stat (all its threads);
# 7,000 requests of about 80 µs make about 56 ticks of 10 ms, so one round resolves about 2%.
# Prints the µs per request of each round, the medians and B / A.
#   bench/request_cpu.sh OLD_BINARY NEW_BINARY        # ROUNDS=5 by default
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# = 2 ] || { sed -n '9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
A=$1 B=$2
ROUNDS=${ROUNDS:-5}
PORT=18743
LAST=$(( $(nproc) - 1 ))
[ "$LAST" -ge 1 ] || { echo "request_cpu.sh: needs two cores (the gateway on one of its own)" >&2; exit 2; }
scripts/setup.sh >/dev/null
cargo build --locked --quiet -p integration-tests --bin s3bench
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  SEAWEED_PORT=$PORT scripts/seaweedfs.sh stop >/dev/null 2>&1 || true
}
trap cleanup EXIT
ENDPOINT=$(SEAWEED_PORT=$PORT scripts/seaweedfs.sh start)
taskset -a -pc "0-$(( LAST - 1 ))" "$(cat ".tmp/seaweedfs-$PORT/pid")" >/dev/null
start() {  # binary listen-port admin-port
  taskset -c "$LAST" "$1" serve --listen "127.0.0.1:$2" --admin-listen "127.0.0.1:$3" \
    --backend-endpoint "$ENDPOINT" --backend-identity transparent --log warn > ".tmp/request-cpu-$2.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 100); do curl -sf "http://127.0.0.1:$3/readyz" >/dev/null && return; sleep 0.1; done
  echo "request_cpu.sh: $1 did not become ready" >&2; exit 1
}
start "$A" 19743 19744
start "$B" 19745 19746
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
TCK=$(getconf CLK_TCK)
# The requests one s3bench run made, from its own lines: a PUT and a GET per object of a
# throughput row, one GET per latency sample.
requests() { python3 -c 'import json, sys
rows = [json.loads(l) for l in sys.stdin if l.strip()]
print(sum(r["count"] * (2 if r["test"] == "throughput" else 1) for r in rows))'; }
declare -A US
for r in $(seq 1 "$ROUNDS"); do
  for side in A B; do
    if [ $side = A ]; then pid=${PIDS[0]} port=19743; else pid=${PIDS[1]} port=19745; fi
    t0=$(ticks "$pid")
    n=$(taskset -c "0-$(( LAST - 1 ))" target/debug/s3bench "http://127.0.0.1:$port" seaweed-ak seaweed-sk "$side" latency | requests)
    t1=$(ticks "$pid")
    us=$(( (t1 - t0) * 1000000 / TCK / n ))
    US[$side]+="$us "
    echo "round $r/$ROUNDS $side: $us µs per request ($n requests)" >&2
  done
done
python3 - "${US[A]}" "${US[B]}" "$A" "$B" <<'PY'
import statistics, sys
a, b = ([int(x) for x in s.split()] for s in sys.argv[1:3])
print(f"A ({sys.argv[3]}): {a} µs per request, median {statistics.median(a)}")
print(f"B ({sys.argv[4]}): {b} µs per request, median {statistics.median(b)}")
print(f"B / A: {statistics.median(b) / statistics.median(a):.3f}")
PY
