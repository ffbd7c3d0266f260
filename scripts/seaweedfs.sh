#!/usr/bin/env bash
# Starts or stops a throwaway SeaweedFS S3 server (from the venv made by scripts/setup.sh).
#   scripts/seaweedfs.sh start   # prints the endpoint; data under .tmp/seaweedfs
#   scripts/seaweedfs.sh stop
# Env: SEAWEED_PORT (S3 port, default 18333; it also uses the next 4 ports and port+10000..+10004),
#      SEAWEED_ACCESS_KEY / SEAWEED_SECRET_KEY (default seaweed-ak / seaweed-sk): identity
#        "tensorgate", Admin of every bucket;
#      SEAWEED_ALT_ACCESS_KEY / SEAWEED_ALT_SECRET_KEY (default seaweed-alt-ak / seaweed-alt-sk):
#        identity "alt", a second user confined to buckets named alt-* (it sees none of the
#        first user's buckets: the multi-user tests and s3-tests' alt user),
#      SEAWEED_DOMAIN (default localhost): virtual-host addressing, a Host of <bucket>.<domain>
#        (path style keeps working),
#      SEAWEED_KEEP=1 (start on the data of the last run instead of wiping it: a restart after a
#        crash, as bench/soak.py does).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${SEAWEED_PORT:-18333}
AK=${SEAWEED_ACCESS_KEY:-seaweed-ak}
SK=${SEAWEED_SECRET_KEY:-seaweed-sk}
ALT_AK=${SEAWEED_ALT_ACCESS_KEY:-seaweed-alt-ak}
ALT_SK=${SEAWEED_ALT_SECRET_KEY:-seaweed-alt-sk}
DIR=.tmp/seaweedfs-$PORT
WEED=.venv/bin/weed
# Each bucket is a SeaweedFS collection with volumes of its own, and the tests make hundreds of
# buckets. Left at 0, the volume limit is the free disk divided by the volume size, so it shrinks
# with the disk the builds leave (a CI run once got InternalError on every PutObject after a few
# dozen buckets; a small disk is the likely cause, and below 1% free the volume server also turns
# read-only, which `weed mini` has no flag for: scripts/test.sh prints the free disk per phase).
# Volumes are sparse files, so a fixed count costs nothing until written.
MAX_VOLUMES=${SEAWEED_MAX_VOLUMES:-2000}
mkdir -p .tmp
# Serialize concurrent starts/stops (tests run in parallel processes).
exec 9>".tmp/seaweedfs-$PORT.lock"
flock 9
case "${1:-start}" in
  start)
    [ -x "$WEED" ] || { echo "seaweedfs.sh: $WEED missing: run scripts/setup.sh first" >&2; exit 1; }
    if [ -f "$DIR/pid" ] && kill -0 "$(cat "$DIR/pid")" 2>/dev/null; then
      echo "http://127.0.0.1:$PORT"; exit 0
    fi
    [ "${SEAWEED_KEEP:-0}" = 1 ] || rm -rf "$DIR"
    mkdir -p "$DIR/data"
    cat > "$DIR/s3.json" <<JSON
{"identities":[{"name":"tensorgate","credentials":[{"accessKey":"$AK","secretKey":"$SK"}],
 "actions":["Admin","Read","List","Tagging","Write"]},
 {"name":"alt","credentials":[{"accessKey":"$ALT_AK","secretKey":"$ALT_SK"}],
 "actions":["Admin:alt-*","Read:alt-*","List:alt-*","Tagging:alt-*","Write:alt-*"]}]}
JSON
    nohup "$WEED" mini -dir="$DIR/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 -master.telemetry=false \
      -s3.config="$DIR/s3.json" -s3.port="$PORT" -s3.domainName="${SEAWEED_DOMAIN:-localhost}" -master.port=$((PORT+1)) -volume.port=$((PORT+2)) \
      -filer.port=$((PORT+3)) -admin.port=$((PORT+4)) -webdav=false -admin.ui=false \
      -s3.port.iceberg=0 -s3.port.lance=0 -master.volumeSizeLimitMB=64 \
      -volume.max="$MAX_VOLUMES" > "$DIR/weed.log" 2>&1 9>&- &
    echo $! > "$DIR/pid"
    for _ in $(seq 1 120); do
      # Ready when a signed ListBuckets succeeds (S3 API, auth and the filer behind it all up).
      code=$(curl -s -o /dev/null -w '%{http_code}' --aws-sigv4 "aws:amz:us-east-1:s3" --user "$AK:$SK" "http://127.0.0.1:$PORT/" || true)
      if [ "$code" = 200 ]; then echo "http://127.0.0.1:$PORT"; exit 0; fi
      sleep 0.5
    done
    echo "seaweedfs.sh: SeaweedFS did not come up; log: $DIR/weed.log" >&2; tail -20 "$DIR/weed.log" >&2; exit 1
    ;;
  stop)
    if [ -f "$DIR/pid" ]; then
      pid=$(cat "$DIR/pid")
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      kill -9 "$pid" 2>/dev/null || true
      rm -f "$DIR/pid"
    fi
    ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
