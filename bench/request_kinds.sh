#!/usr/bin/env bash
# CPU per small request, by kind: 4 KiB PUT, GET, HEAD, ListObjectsV2 of 100 keys, DeleteObject
# and a cached pushdown hit (`s3bench ... kinds`), for the gateway in transparent mode, in
# terminating mode (verifies and re-signs), and for nginx as a plain reverse proxy, all three on
# the last core, beside one SeaweedFS that shares the other cores with the client. Each round
# runs every proxy once, in an order that rotates by round, so no proxy is always first or last.
# Prints the µs of CPU per request of each proxy and kind (medians over rounds, and every round)
# and each gateway's median over nginx's. The proxies' core is kept busy (see BUSY below). nginx has no pushdown: its row for the pushdown hit is
# its 4 KiB GET (a cached output is about that size, 2 KiB for tiny-cnn at `pool`).
#   bench/request_kinds.sh                       # ROUNDS=5, KINDS_COUNT=2000, KINDS_CONCURRENCY=8
#   GATEWAY_BIN=/tmp/tg-new bench/request_kinds.sh   # another build (default: the release build)
#   BASELINE_BIN=/tmp/tg-old bench/request_kinds.sh  # that build too, in both modes, in the same
#                                                # rounds: new / old per kind (an A/B of a change)
#   ONLY=transparent,nginx bench/request_kinds.sh   # some proxies only
#   KINDS=get,mixed KINDS_CONCURRENCY=64 bench/request_kinds.sh   # 64 in flight: requests per
#                                                # second and p99 beside the CPU (on two cores,
#                                                # those of the store and client, not the proxies)
#   PROXY_QUOTA=4 KINDS=get,mixed KINDS_CONCURRENCY=64 bench/request_kinds.sh   # saturation: each
#                                                # proxy held to 4% of its core (bench/lib/quota.sh),
#                                                # so it is the bound; throttled periods shown
#   PERF=transparent:get bench/request_kinds.sh  # then `perf record -g` of that proxy over one
#                                                # more run of that kind: .tmp/perf-<proxy>-<kind>.data
#   STRACE=nginx:get bench/request_kinds.sh      # the same with `strace -c -f` (system calls per
#                                                # request): .tmp/strace-<proxy>-<kind>.txt
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-5}
GATEWAY_BIN=${GATEWAY_BIN:-target/release/tensorgate}
PORT=18753
LAST=$(( $(nproc) - 1 ))
[ "$LAST" -ge 1 ] || { echo "request_kinds.sh: needs two cores (the proxies on one of their own)" >&2; exit 2; }
PROXY_PIN=(taskset -c "$LAST") REST_PIN=(taskset -c "0-$(( LAST - 1 ))")
scripts/setup.sh >/dev/null
cargo build --release --locked --quiet --bin tensorgate
cargo build --locked --quiet -p integration-tests --bin s3bench
. bench/lib/nginx.sh
. bench/lib/quota.sh
ensure_nginx bench/request_kinds.sh || { echo "request_kinds.sh: nginx is needed (the anchor)" >&2; exit 2; }
ORT=$(ls .venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so.* | head -1)
OUT=.tmp/request-kinds; rm -rf "$OUT"; mkdir -p "$OUT"
PIDS=() NGINX_PID=
# BUSY=1 (the default): the proxies' core kept busy by a SCHED_IDLE spinner, which yields to any
# other thread at once, as a storage node's cores are: no proxy pays the idle core's wake-up, and
# rounds spread far less than on an idle core (BUSY=0).
if [ "${BUSY:-1}" = 1 ]; then
  chrt -i 0 taskset -c "$LAST" sh -c 'while :; do :; done' &
  PIDS+=($!)
fi
cleanup() {
  quota_stop
  for p in "${PIDS[@]}" $NGINX_PID; do kill "$p" 2>/dev/null || true; done
  SEAWEED_PORT=$PORT scripts/seaweedfs.sh stop >/dev/null 2>&1 || true
}
trap cleanup EXIT
ENDPOINT=$(SEAWEED_PORT=$PORT scripts/seaweedfs.sh start)
taskset -a -pc "0-$(( LAST - 1 ))" "$(cat ".tmp/seaweedfs-$PORT/pid")" >/dev/null
declare -A ADDR PID KEYS ADMIN_OF
gateway() {  # name binary listen admin [flags...]
  local name=$1 bin=$2 listen=$3 admin=$4; shift 4
  env -u TENSORGATE_CONFIG TENSORGATE_MODELS_DIR="$PWD/models" TENSORGATE_ORT_LIBRARY="$ORT" \
    "${PROXY_PIN[@]}" "$bin" serve --listen "$listen" --admin-listen "$admin" \
    --backend-endpoint "$ENDPOINT" --log warn "$@" > "$OUT/$name.log" 2>&1 &
  PIDS+=($!) ; PID[$name]=$! ADDR[$name]=http://$listen ADMIN_OF[$name]=$admin
  for _ in $(seq 1 300); do curl -sf "http://$admin/readyz" >/dev/null && return; sleep 0.1; done
  echo "request_kinds.sh: the $name gateway did not become ready ($OUT/$name.log)" >&2; exit 1
}
ALL=(transparent terminating nginx)
[ -n "${BASELINE_BIN:-}" ] && ALL+=(transparent@base terminating@base)
NAMES=()
for n in "${ALL[@]}"; do [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",${n%@base},"* ]] && NAMES+=("$n"); done
[ ${#NAMES[@]} -gt 0 ] || { echo "ONLY=$ONLY: transparent, terminating or nginx (comma-separated)" >&2; exit 2; }
port=19753
for n in "${NAMES[@]}"; do
  bin=$GATEWAY_BIN; [[ $n == *@base ]] && bin=$BASELINE_BIN
  case ${n%@base} in
    transparent) gateway "$n" "$bin" "127.0.0.1:$port" "127.0.0.1:$(( port + 1 ))" --backend-identity transparent
                 KEYS[$n]="seaweed-ak seaweed-sk" ;;
    terminating) gateway "$n" "$bin" "127.0.0.1:$port" "127.0.0.1:$(( port + 1 ))" --backend-access-key seaweed-ak \
                   --backend-secret-key seaweed-sk --access-key bench-ak --secret-key bench-sk
                 KEYS[$n]="bench-ak bench-sk" ;;
    nginx) start_nginx "127.0.0.1:$port" "$ENDPOINT" "${PROXY_PIN[@]}"
           PID[$n]=$NGINX_WORKER ADDR[$n]=http://127.0.0.1:$port KEYS[$n]="seaweed-ak seaweed-sk" ;;
  esac
  if [ -n "${PROXY_QUOTA:-}" ]; then
    procs=("${PID[$n]}"); [ "$n" = nginx ] && procs+=("$NGINX_PID")
    quota_start "$n" "$PROXY_QUOTA" "${procs[@]}" || { echo "request_kinds.sh: PROXY_QUOTA needs root and a cgroup cpu controller" >&2; exit 2; }
  fi
  port=$(( port + 2 ))
done
IMAGE=fuzz/corpus/image/rgb.jpg
PERF=${PERF:-}
for r in $(seq 1 "$ROUNDS"); do
  k=${#NAMES[@]}
  for i in $(seq 0 $(( k - 1 ))); do
    n=${NAMES[$(( (i + r) % k ))]}
    echo "round $r/$ROUNDS: $n" >&2
    hook=(); [ -n "${PROXY_QUOTA:-}" ] && hook=(KINDS_HOOK="bench/lib/quota_hook.sh ${QUOTA_DIR[$n]} $OUT/raw.jsonl $n $r")
    push=(); [ "$n" != nginx ] && [[ ",${KINDS:-pushdown}," == *,pushdown,* ]] && push=(PUSHDOWN="tiny-cnn:pool:$IMAGE")
    # shellcheck disable=SC2086
    env "${push[@]}" "${hook[@]}" CPU_PIDS="proxy:${PID[$n]}" "${REST_PIN[@]}" target/debug/s3bench \
      "${ADDR[$n]}" ${KEYS[$n]} "$n" kinds >> "$OUT/raw.jsonl"
    if [ ${#push[@]} -gt 0 ]; then  # every pushdown request of the phase was a cache hit
      hits=$(curl -sf "http://${ADMIN_OF[$n]}/metrics" | awk '/^tensorgate_cache_hits_total/ {s += $2} END {print s + 0}')
      echo "{\"label\":\"$n\",\"test\":\"hits\",\"round\":$r,\"hits\":$hits}" >> "$OUT/raw.jsonl"
    fi
  done
done
for spec in ${PERF:+perf:$PERF} ${STRACE:+strace:$STRACE}; do
  tool=${spec%%:*} rest=${spec#*:}; n=${rest%%:*} kind=${rest#*:}
  case $tool in
    perf) trace=(perf record ${PERF_CALLGRAPH:---call-graph dwarf,16384} -F 2000 -o ".tmp/perf-$n-$kind.data" -p "${PID[$n]}") ;;
    strace) trace=(strace -c -f -o ".tmp/strace-$n-$kind.txt" -p "${PID[$n]}") ;;
  esac
  "${trace[@]}" 2> "$OUT/$tool.log" & TRACE_PID=$!
  sleep 1
  # shellcheck disable=SC2086
  KINDS=$kind PUSHDOWN="tiny-cnn:pool:$IMAGE" "${REST_PIN[@]}" target/debug/s3bench "${ADDR[$n]}" ${KEYS[$n]} "$n" kinds >&2
  kill -INT $TRACE_PID; wait $TRACE_PID || true
  echo "$tool of $n over $kind: .tmp/$tool-$n-$kind.*" >&2
done
python3 - "$OUT/raw.jsonl" <<'PY'
import collections, json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
runs = collections.defaultdict(list)
for r in rows:
    if r["test"] == "kind":
        runs[(r["label"], r["kind"])].append(r)
hits = {r["label"]: r["hits"] for r in rows if r["test"] == "hits"}  # the last round's count
for n, h in hits.items():  # every measured pushdown request was a hit (else the row is not one)
    want = sum(x["count"] for x in rows if x["test"] == "kind" and x["label"] == n and x["kind"] == "pushdown")
    assert h >= want, f"{n}: {h} cache hits for {want} measured pushdown requests"
names = [n for n in ("transparent", "terminating", "nginx", "transparent@base", "terminating@base")
         if any(l == n for l, _ in runs)]
kinds = [k for k in ("get", "put", "head", "delete", "list", "mixed", "pushdown") if any(k == x for _, x in runs)]
def med(n, k, field):
    v = [r[field] for r in runs.get((n, k), [])]
    return statistics.median(v) if v else None
def anchor(n, k):  # what a row is compared with: nginx's same kind (its GET for a pushdown hit)
    if n.endswith("@base"):
        return None
    return ("nginx", "get" if k == "pushdown" else k)
for field, title, fmt in (("proxy_cpu_us", "CPU µs per request", "{:.1f}"), ("ops_s", "requests per second", "{:.0f}"),
                          ("p99_ms", "p99 ms", "{:.2f}")):
    print(f"{title} (medians over rounds):")
    ratios = [n for n in names if n != "nginx" and not n.endswith("@base")]
    bases = [n for n in names if n.endswith("@base")]
    head = [f"{n}" for n in names] + [f"{n} / nginx" for n in ratios if "nginx" in names] + [f"{b[:-5]} new / base" for b in bases]
    print("| kind | " + " | ".join(head) + " |")
    print("|---" * (1 + len(head)) + "|")
    for k in kinds:
        cells = []
        for n in names:
            m = med(n, k, field)
            if m is None and n == "nginx" and k == "pushdown":
                cells.append("(GET) " + fmt.format(med(n, "get", field)) if med(n, "get", field) is not None else "-")
            else:
                cells.append(fmt.format(m) if m is not None else "-")
        for n in ratios if "nginx" in names else []:
            a, b = med(n, k, field), med(*anchor(n, k), field)
            cells.append(f"{a / b:.2f}" if a and b else "-")
        for b in bases:
            new, old = med(b[:-5], k, field), med(b, k, field)
            cells.append(f"{new / old:.3f}" if new and old else "-")
        print(f"| {k} | " + " | ".join(cells) + " |")
    print()
for (n, k), v in sorted(runs.items()):
    print(f"{n} {k}: µs " + ", ".join(f"{x['proxy_cpu_us']:.1f}" for x in v) + "; req/s " + ", ".join(f"{x['ops_s']:.0f}" for x in v))
for n, h in hits.items():
    print(f"{n}: {h:.0f} cache hits in all (every measured pushdown request)")
quota = collections.defaultdict(lambda: [0, 0])
for r in rows:
    if r["test"] == "quota":
        quota[(r["label"], r["kind"])][0] += r["periods"]
        quota[(r["label"], r["kind"])][1] += r["throttled"]
for (n, k), (periods, throttled) in sorted(quota.items()):  # near 100%: the quota was the bound
    share = throttled / max(periods, 1)
    note = "" if share >= 0.9 else ": NOT the bound (lower PROXY_QUOTA), its req/s are the store's"
    print(f"{n} {k}: throttled in {throttled} of {periods} CPU quota periods ({100 * share:.0f}%){note}")
PY
