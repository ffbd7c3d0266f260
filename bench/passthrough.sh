#!/usr/bin/env bash
# Passthrough overhead: the same aws-sdk-s3 workload against SeaweedFS directly, through the gateway
# (release build) and through nginx as a plain reverse proxy (Debian's nginx, one worker: the
# real-world anchor, what a user who needs only a proxy would run), alternating, in one run; then
# the gateway's peak RSS over a 1 GiB PUT + GET. CPU seconds per GB of each process are reported,
# for the whole workload and for each object size and operation.
# Prints a markdown report and saves it (and the raw JSON lines) under bench/results/.
#   bench/passthrough.sh            # ROUNDS=2 by default
#   GATEWAY_BIN=path/to/tensorgate bench/passthrough.sh   # another build (default: the release build)
#   PIN=0 bench/passthrough.sh      # unpinned (default PIN=1: the gateway alone on the last core,
#                                   # store and client on the others, so the ratios show what the
#                                   # gateway costs with a core of its own, not core contention;
#                                   # nginx gets the same core)
#   IDENTITY=transparent bench/passthrough.sh   # the gateway in transparent identity mode (no
#                                   # keys; the client signs with the store's own key, ADR 0013)
#   TENSORGATE__BACKEND__CHECKS_PAYLOAD_HASH=true IDENTITY=transparent SUFFIX=-transparent-storehash \
#     bench/passthrough.sh          # any gateway config key from the environment; SUFFIX names
#                                   # the result files (default: "-transparent" or none)
#   ONLY=latency ROUNDS=5 bench/passthrough.sh   # only the 4 KiB GET latency rows (p50, p99),
#                                   # no throughput rows and no 1 GiB transfer: for tail latency
#   BUSY=1 bench/passthrough.sh     # the proxy's core kept busy by a SCHED_IDLE spinner (it yields
#                                   # to any other thread at once), so the core never idles between
#                                   # requests: takes the machine's wake-from-idle latency out of
#                                   # the latency rows, as on a storage node with other work
#                                   # (docs/BENCHMARKS.md, "The p99 is the idle core's wake-up")
#   NGINX=0 bench/passthrough.sh    # without the nginx anchor (nginx is installed from Debian when
#                                   # missing and running as root; otherwise it is left out)
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-2}
ONLY=${ONLY:-}
case $ONLY in
  "") MODE=() ;;
  latency) MODE=(latency) ;;
  *) echo "ONLY=$ONLY: latency, or unset for every row" >&2; exit 2 ;;
esac
IDENTITY=${IDENTITY:-terminating}
case $IDENTITY in
  terminating) GW_KEYS=(--backend-access-key seaweed-ak --backend-secret-key seaweed-sk --access-key bench-ak --secret-key bench-sk)
               GW_CLIENT=(bench-ak bench-sk) ;;
  transparent) GW_KEYS=(--backend-identity transparent); GW_CLIENT=(seaweed-ak seaweed-sk) ;;
  *) echo "IDENTITY=$IDENTITY: terminating or transparent" >&2; exit 2 ;;
esac
PORT=18733
GW=127.0.0.1:19733
ADMIN=127.0.0.1:19734
NGINX_ADDR=127.0.0.1:19735
OUT=bench/results
mkdir -p "$OUT" .tmp
SUFFIX=${SUFFIX-$([ "$IDENTITY" = transparent ] && echo "-transparent" || true)}${ONLY:+-$ONLY}
RAW="$OUT/passthrough${SUFFIX}-raw.jsonl"
# Each sequential 4 KiB GET's milliseconds (s3bench's LATENCY_OUT), pooled over rounds in the report.
export LATENCY_OUT="$OUT/passthrough${SUFFIX}-ms.jsonl"
: > "$RAW"; : > "$LATENCY_OUT"

scripts/setup.sh >/dev/null
cargo build --release --locked --quiet --bin tensorgate
cargo build --locked --quiet -p integration-tests --bin s3bench
BENCH=target/debug/s3bench

NGINX=${NGINX:-1}
. bench/lib/nginx.sh
if [ "$NGINX" = 1 ] && ! ensure_nginx bench/passthrough.sh; then
  NGINX=0; echo "bench/passthrough.sh: no nginx, the anchor is left out" >&2
fi

GW_PID= NGINX_PID= SPIN_PID=
cleanup() {
  [ -n "$SPIN_PID" ] && kill "$SPIN_PID" 2>/dev/null || true
  [ -n "$GW_PID" ] && kill "$GW_PID" 2>/dev/null || true
  [ -n "$NGINX_PID" ] && kill "$NGINX_PID" 2>/dev/null || true
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
BUSY=${BUSY:-0}
if [ "$BUSY" = 1 ]; then
  [ "$PIN" = 1 ] || { echo "BUSY=1 needs PIN=1 (a core of the proxy's own to keep busy)" >&2; exit 2; }
  chrt -i 0 taskset -c "$GW_CPUS" sh -c 'while :; do :; done' &
  SPIN_PID=$!
fi
ENDPOINT=$(SEAWEED_PORT=$PORT scripts/seaweedfs.sh start)
[ "$PIN" = 1 ] && taskset -a -pc "$REST_CPUS" "$(cat ".tmp/seaweedfs-$PORT/pid")" >/dev/null
"${GW_PIN[@]}" "${GATEWAY_BIN:-target/release/tensorgate}" serve --listen "$GW" --admin-listen "$ADMIN" \
  --backend-endpoint "$ENDPOINT" "${GW_KEYS[@]}" --log warn > .tmp/bench-gateway.log 2>&1 &
GW_PID=$!
for _ in $(seq 1 100); do curl -sf "http://$ADMIN/readyz" >/dev/null && break; sleep 0.1; done

[ "$NGINX" = 1 ] && start_nginx "$NGINX_ADDR" "$ENDPOINT" "${GW_PIN[@]}"

WEED_PID=$(cat ".tmp/seaweedfs-$PORT/pid")
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }  # utime + stime, in clock ticks
TCK=$(getconf CLK_TCK)
# Runs one labelled workload and records the CPU seconds each process spent on it.
measure() {
  local label=$1 proxy=$2; shift 2
  local g0 w0 g1 w1
  g0=0; [ -n "$proxy" ] && g0=$(cpu "$proxy"); w0=$(cpu "$WEED_PID")
  # s3bench also records the proxy's and the store's CPU over each PUT and GET phase (per row).
  local pids="store:$WEED_PID"; [ -n "$proxy" ] && pids="proxy:$proxy,$pids"
  CPU_PIDS=$pids "${REST_PIN[@]}" /usr/bin/time -f "%U %S" -o .tmp/bench-client-cpu "$@" >> "$RAW"
  g1=0; [ -n "$proxy" ] && g1=$(cpu "$proxy"); w1=$(cpu "$WEED_PID")
  read -r cu cs < .tmp/bench-client-cpu
  echo "{\"label\":\"$label\",\"test\":\"cpu\",\"proxy_cpu_s\":$(( (g1 - g0) ))e-2,\"store_cpu_s\":$(( (w1 - w0) ))e-2,\"client_cpu_s\":$(echo "$cu + $cs" | bc)}" >> "$RAW"
  [ "$TCK" = 100 ] || echo "warning: CLK_TCK=$TCK, CPU seconds above assume 100" >&2
}

for r in $(seq 1 "$ROUNDS"); do
  echo "round $r/$ROUNDS: direct" >&2
  measure direct "" $BENCH "$ENDPOINT" seaweed-ak seaweed-sk direct "${MODE[@]}"
  echo "round $r/$ROUNDS: gateway" >&2
  measure gateway "$GW_PID" $BENCH "http://$GW" "${GW_CLIENT[@]}" gateway "${MODE[@]}"
  if [ "$NGINX" = 1 ]; then
    echo "round $r/$ROUNDS: nginx" >&2
    measure nginx "$NGINX_WORKER" $BENCH "http://$NGINX_ADDR" seaweed-ak seaweed-sk nginx "${MODE[@]}"
  fi
done

if [ -z "$ONLY" ]; then
echo "1 GiB PUT + GET through the gateway" >&2
head -c $((1024 * 1024 * 1024)) /dev/zero > .tmp/bench-1g.bin
rss_before=$(awk '/VmHWM/ {print $2}' "/proc/$GW_PID/status")
CPU_PIDS=proxy:$GW_PID "${REST_PIN[@]}" $BENCH "http://$GW" "${GW_CLIENT[@]}" gateway big .tmp/bench-1g.bin >> "$RAW"
rss_after=$(awk '/VmHWM/ {print $2}' "/proc/$GW_PID/status")
echo "{\"label\":\"gateway\",\"test\":\"rss\",\"hwm_before_kib\":$rss_before,\"hwm_after_kib\":$rss_after}" >> "$RAW"
fi

{ echo "Gateway identity mode: $IDENTITY."; echo; [ "$PIN" = 1 ] && echo "Pinned: gateway (and nginx) on CPU $GW_CPUS; SeaweedFS and the client on CPUs $REST_CPUS." && echo; [ "$BUSY" = 1 ] && echo "CPU $GW_CPUS kept busy by a SCHED_IDLE spinner (BUSY=1)." && echo; .venv/bin/python bench/report.py "$RAW" "$LATENCY_OUT"; } | tee "$OUT/passthrough${SUFFIX}.md"
