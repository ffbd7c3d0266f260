#!/usr/bin/env bash
# Instructions and heap allocations per small request, by kind, counted exactly: the gateway
# runs under valgrind's callgrind beside one SeaweedFS, and `s3bench ... kinds` (KINDS_COUNT=300
# of each, 8 in flight) has its counts zeroed before each kind's phase and dumped after it
# (bench/lib/callgrind_hook.sh). Prints, per mode and kind, the instructions (Ir) and the calls
# of malloc, calloc and realloc per request. User space only (the kernel's share, system calls
# and copies, is not counted), and repeatable to about 1%, where CPU time on this VM spreads 15%
# between rounds (bench/request_kinds.sh): the number to compare two builds by. nginx, the
# anchor of bench/request_kinds.sh, is not counted here (no way to mark its phases).
#   bench/request_instructions.sh                   # transparent and terminating
#   BASELINE_BIN=/tmp/tg-old bench/request_instructions.sh   # and that build in both modes
#   ONLY=transparent KINDS=get bench/request_instructions.sh
#   callgrind_annotate --inclusive=yes .tmp/request-instructions/transparent-get.cg   # where
set -euo pipefail
cd "$(dirname "$0")/.."
GATEWAY_BIN=${GATEWAY_BIN:-target/release/tensorgate}
export KINDS_COUNT=${KINDS_COUNT:-300} KINDS=${KINDS:-get,put,head,delete,list,pushdown}
PORT=18763
scripts/setup.sh >/dev/null
cargo build --release --locked --quiet --bin tensorgate
cargo build --locked --quiet -p integration-tests --bin s3bench
. scripts/debian-packages.sh
[ -x /usr/bin/valgrind ] || ensure_debian_packages /usr/bin/valgrind valgrind bench/request_instructions.sh
ORT=$(ls .venv/lib/python3*/site-packages/onnxruntime/capi/libonnxruntime.so.* | head -1)
OUT=$PWD/.tmp/request-instructions; rm -rf "$OUT"; mkdir -p "$OUT"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  SEAWEED_PORT=$PORT scripts/seaweedfs.sh stop >/dev/null 2>&1 || true
}
trap cleanup EXIT
ENDPOINT=$(SEAWEED_PORT=$PORT scripts/seaweedfs.sh start)
VG=(valgrind --tool=callgrind --callgrind-out-file="$OUT/callgrind.out.%p" --dump-instr=no --vgdb=no --trace-children=yes
    "--zero-before=*pushdown::registry::Registry::digest*" "--dump-before=*metrics::Metrics::render*")
ALL=(transparent terminating)
[ -n "${BASELINE_BIN:-}" ] && ALL+=(transparent@base terminating@base)
port=19763
: > "$OUT/raw.jsonl"
for n in "${ALL[@]}"; do
  [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",${n%@base},"* ]] || continue
  bin=$GATEWAY_BIN; [[ $n == *@base ]] && bin=$BASELINE_BIN
  keys="seaweed-ak seaweed-sk"
  flags=(--backend-identity transparent)
  [ "${n%@base}" = terminating ] && flags=(--backend-access-key seaweed-ak --backend-secret-key seaweed-sk
    --access-key bench-ak --secret-key bench-sk) && keys="bench-ak bench-sk"
  admin=127.0.0.1:$(( port + 1 ))
  env -u TENSORGATE_CONFIG TENSORGATE_MODELS_DIR="$PWD/models" TENSORGATE_ORT_LIBRARY="$ORT" \
    "${VG[@]}" "$bin" serve --listen "127.0.0.1:$port" --admin-listen "$admin" \
    --backend-endpoint "$ENDPOINT" --log warn "${flags[@]}" > "$OUT/$n.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do curl -sf "http://$admin/readyz" >/dev/null && break; sleep 0.2; done
  PIDS+=("$pid")
  echo "$n (pid $pid)" >&2
  # shellcheck disable=SC2086
  PUSHDOWN="tiny-cnn:pool:fuzz/corpus/image/rgb.jpg" KINDS_HOOK="bench/lib/callgrind_hook.sh $admin $OUT $n" target/debug/s3bench \
    "http://127.0.0.1:$port" $keys "$n" kinds >> "$OUT/raw.jsonl"
  kill "$pid"; wait "$pid" 2>/dev/null || true
  port=$(( port + 2 ))
done
python3 - "$OUT" <<'PY'
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
counts = {(r["label"], r["kind"]): r["count"] for r in map(json.loads, open(out / "raw.jsonl")) if r.get("test") == "kind"}
ALLOC = {"malloc", "calloc", "realloc"}
def parse(path):
    """Total Ir and the calls into the allocator's entry points, from a callgrind dump."""
    names, total, allocs, target = {}, 0, 0, None
    for line in open(path, errors="replace"):
        if line.startswith(("totals:", "summary:")):
            total = int(line.split()[1])
        m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line)
        if m:
            if m.group(2):
                names[m.group(1)] = m.group(2).strip()
            target = names.get(m.group(1)) if line.startswith("cfn") else None
        elif line.startswith("calls=") and target is not None:
            if target.split("'")[0] in ALLOC:
                allocs += int(line.split("=")[1].split()[0])
            target = None
    return total, allocs
rows = {}
for (label, kind), n in counts.items():
    f = out / f"{label}-{kind}.cg"
    if f.exists():
        ir, allocs = parse(f)
        rows[(label, kind)] = (ir / n, allocs / n)
labels = [l for l in ("transparent", "terminating", "transparent@base", "terminating@base") if any(l == x for x, _ in rows)]
kinds = [k for k in ("get", "put", "head", "delete", "list", "pushdown") if any(k == x for _, x in rows)]
print("| kind | " + " | ".join(f"{l}: instructions, allocations" for l in labels) + " |")
print("|---" * (1 + len(labels)) + "|")
for k in kinds:
    cells = []
    for l in labels:
        v = rows.get((l, k))
        cells.append(f"{v[0] / 1e3:.1f} k, {v[1]:.1f}" if v else "-")
    print(f"| {k} | " + " | ".join(cells) + " |")
for l in labels:
    if l.endswith("@base"):
        print(f"{l[:-5]} new / base, instructions: " + ", ".join(
            f"{k} {rows[(l[:-5], k)][0] / rows[(l, k)][0]:.3f}" for k in kinds if (l, k) in rows and (l[:-5], k) in rows))
PY
