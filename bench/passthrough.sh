#!/usr/bin/env bash
# Passthrough overhead: the same aws-sdk-s3 workload against SeaweedFS directly and through the
# gateway (release build), alternating, in one run; then the gateway's peak RSS over a 1 GiB PUT + GET.
# Prints a markdown report and saves it (and the raw JSON lines) under bench/results/.
#   bench/passthrough.sh            # ROUNDS=2 by default
#   GATEWAY_BIN=path/to/tensorgate bench/passthrough.sh   # another build (default: the release build)
#   PIN=0 bench/passthrough.sh      # unpinned (default PIN=1: the gateway alone on the last core,
#                                   # store and client on the others, so the ratios show what the
#                                   # gateway costs with a core of its own, not core contention)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
PORT=18733
GW=127.0.0.1:19733
ADMIN=127.0.0.1:19734
OUT=bench/results
mkdir -p "$OUT" .tmp
RAW="$OUT/passthrough-raw.jsonl"
: > "$RAW"

scripts/setup.sh >/dev/null
cargo build --release --locked --quiet --bin tensorgate
cargo build --locked --quiet -p integration-tests --bin s3bench
BENCH=target/debug/s3bench

GW_PID=
cleanup() {
  [ -n "$GW_PID" ] && kill "$GW_PID" 2>/dev/null || true
  SEAWEED_PORT=$PORT scripts/seaweedfs.sh stop >/dev/null 2>&1 || true
  rm -f .tmp/bench-1g.bin
}
trap cleanup EXIT

PIN=${PIN:-1}
LAST=$(( $(nproc) - 1 ))
# Command prefixes (taskset execs the command: the gateway's PID is its own).
GW_PIN=() REST_PIN=()
if [ "$PIN" = 1 ] && [ "$LAST" -ge 1 ]; then
  GW_CPUS=$LAST REST_CPUS=0-$(( LAST - 1 ))
  GW_PIN=(taskset -c "$GW_CPUS") REST_PIN=(taskset -c "$REST_CPUS")
else
  PIN=0
fi
ENDPOINT=$(SEAWEED_PORT=$PORT scripts/seaweedfs.sh start)
[ "$PIN" = 1 ] && taskset -a -pc "$REST_CPUS" "$(cat ".tmp/seaweedfs-$PORT/pid")" >/dev/null
"${GW_PIN[@]}" "${GATEWAY_BIN:-target/release/tensorgate}" serve --listen "$GW" --admin-listen "$ADMIN" \
  --backend-endpoint "$ENDPOINT" --backend-access-key seaweed-ak --backend-secret-key seaweed-sk \
  --access-key bench-ak --secret-key bench-sk --log warn > .tmp/bench-gateway.log 2>&1 &
GW_PID=$!
for _ in $(seq 1 100); do curl -sf "http://$ADMIN/readyz" >/dev/null && break; sleep 0.1; done

WEED_PID=$(cat ".tmp/seaweedfs-$PORT/pid")
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }  # utime + stime, in clock ticks
TCK=$(getconf CLK_TCK)
# Runs one labelled workload and records the CPU seconds each process spent on it.
measure() {
  local label=$1; shift
  local g0 w0 c0 g1 w1 c1
  g0=$(cpu "$GW_PID"); w0=$(cpu "$WEED_PID")
  "${REST_PIN[@]}" /usr/bin/time -f "%U %S" -o .tmp/bench-client-cpu "$@" >> "$RAW"
  g1=$(cpu "$GW_PID"); w1=$(cpu "$WEED_PID")
  read -r cu cs < .tmp/bench-client-cpu
  echo "{\"label\":\"$label\",\"test\":\"cpu\",\"gateway_cpu_s\":$(( (g1 - g0) ))e-2,\"store_cpu_s\":$(( (w1 - w0) ))e-2,\"client_cpu_s\":$(echo "$cu + $cs" | bc)}" >> "$RAW"
  [ "$TCK" = 100 ] || echo "warning: CLK_TCK=$TCK, CPU seconds above assume 100" >&2
}

for r in $(seq 1 "$ROUNDS"); do
  echo "round $r/$ROUNDS: direct" >&2
  measure direct $BENCH "$ENDPOINT" seaweed-ak seaweed-sk direct
  echo "round $r/$ROUNDS: gateway" >&2
  measure gateway $BENCH "http://$GW" bench-ak bench-sk gateway
done

echo "1 GiB PUT + GET through the gateway" >&2
head -c $((1024 * 1024 * 1024)) /dev/zero > .tmp/bench-1g.bin
rss_before=$(awk '/VmHWM/ {print $2}' "/proc/$GW_PID/status")
"${REST_PIN[@]}" $BENCH "http://$GW" bench-ak bench-sk gateway big .tmp/bench-1g.bin >> "$RAW"
rss_after=$(awk '/VmHWM/ {print $2}' "/proc/$GW_PID/status")
echo "{\"label\":\"gateway\",\"test\":\"rss\",\"hwm_before_kib\":$rss_before,\"hwm_after_kib\":$rss_after}" >> "$RAW"

{ [ "$PIN" = 1 ] && echo "Pinned: gateway on CPU $GW_CPUS; SeaweedFS and the client on CPUs $REST_CPUS." && echo; .venv/bin/python bench/report.py "$RAW"; } | tee "$OUT/passthrough.md"
