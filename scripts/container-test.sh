#!/usr/bin/env bash
# Builds the container image from this checkout and tests it beside a real SeaweedFS:
# tests/container/test_container.py (aws CLI, boto3, pushdowns bit-identical to the binary), its
# health check, that it runs as non-root, and that docker/compose.yml is a valid compose file
# (docker-compose from Debian). Needs root for Docker: installs Debian's docker.io and
# debootstrap when missing, starts dockerd without a bridge (containers use the host's loopback),
# and makes a local Debian bookworm base with debootstrap (public base images are not needed).
#   scripts/container-test.sh              # the release binary (built if needed)
#   PROFILE=debug scripts/container-test.sh  # the debug binary the tests built (no release build)
set -euo pipefail
cd "$(dirname "$0")/.."
SEAWEED_PORT=${SEAWEED_PORT:-18833}
S3_PORT=${CONTAINER_S3_PORT:-19953}
ADMIN_PORT=$((S3_PORT + 1))
NAME=tensorgate-container-test
DOCKER=/usr/bin/docker  # Debian's client: BuildKit built in

cleanup() {
  $DOCKER rm -f "$NAME" >/dev/null 2>&1 || true
  SEAWEED_PORT=$SEAWEED_PORT scripts/seaweedfs.sh stop >/dev/null 2>&1 || true
}
trap cleanup EXIT

PROFILE=${PROFILE:-release}
# shellcheck source=debian-packages.sh
. scripts/debian-packages.sh
ensure_debian_packages "dockerd debootstrap" "docker.io debootstrap" container-test 2>/dev/null
# dockerd refuses to start while /var/run/docker.pid names a process, and a machine restored from
# a snapshot (as CI's are) can carry the file of a daemon that no longer runs: such a file is
# removed. A first start initialises /var/lib/docker, so it is given DOCKERD_WAIT_S (default 120 s).
start_dockerd() {
  $DOCKER info >/dev/null 2>&1 && return 0
  local pidfile=/var/run/docker.pid pid
  if [ -f "$pidfile" ]; then
    pid=$(cat "$pidfile" 2>/dev/null || true)
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null || [ "$(cat "/proc/$pid/comm" 2>/dev/null)" != dockerd ]; then
      echo "removing a stale $pidfile (pid ${pid:-none} is not a running dockerd)"
      rm -f "$pidfile"
    fi
  fi
  (dockerd --bridge=none --iptables=false >/tmp/tensorgate-dockerd.log 2>&1 &)
  local deadline=$(( $(date +%s) + ${DOCKERD_WAIT_S:-120} ))
  until $DOCKER info >/dev/null 2>&1; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "dockerd did not answer within ${DOCKERD_WAIT_S:-120} s; the end of its log:"
      tail -20 /tmp/tensorgate-dockerd.log
      exit 1
    fi
    sleep 0.5
  done
}
start_dockerd
if ! $DOCKER image inspect tensorgate-base:bookworm >/dev/null 2>&1; then
  root=$(mktemp -d)
  debootstrap --variant=minbase bookworm "$root" >/dev/null
  tar -C "$root" -c . | $DOCKER import - tensorgate-base:bookworm >/dev/null
  rm -rf "$root"
fi

echo "== image"
scripts/setup.sh >/dev/null
scripts/models.sh >/dev/null
if [ "$PROFILE" = release ]; then
  cargo build --release --locked --quiet --bin tensorgate
else
  cargo build --workspace --locked --quiet --bins  # the test suite's build (workspace features)
fi
rm -rf docker/prebuilt && mkdir -p docker/prebuilt/onnxruntime docker/prebuilt/models
cp "target/$PROFILE/tensorgate" docker/prebuilt/
cp .venv/lib/python3.11/site-packages/onnxruntime/capi/libonnxruntime.so.* docker/prebuilt/onnxruntime/libonnxruntime.so
for m in models/*/; do [ "$(basename "$m")" = fixtures ] || cp -r "$m" docker/prebuilt/models/; done
DOCKER_BUILDKIT=1 $DOCKER build --network host -q -f docker/Dockerfile \
  --build-arg ARTIFACTS=prebuilt --build-arg BASE=tensorgate-base:bookworm -t tensorgate:test .
rm -rf docker/prebuilt

echo "== docker/compose.yml (schema; MinIO's image is not reachable here, so it is not run)"
if ensure_debian_packages "docker-compose" "docker-compose" container-test 2>/dev/null; then
  # Valid with the operator's MinIO root credentials set, refused without them (it publishes none);
  # tests/python/test_deploy.py checks what the rendered file gives the gateway.
  MINIO_ROOT_USER=u MINIO_ROOT_PASSWORD=p docker-compose -f docker/compose.yml config -q
  if env -u MINIO_ROOT_USER -u MINIO_ROOT_PASSWORD docker-compose -f docker/compose.yml config -q 2>/dev/null; then
    echo "docker/compose.yml renders without the operator's MinIO root credentials" >&2
    exit 1
  fi
  echo "compose file valid"
else
  echo "docker-compose not installable: compose file not checked"
fi

echo "== container beside SeaweedFS"
seaweed=$(SEAWEED_PORT=$SEAWEED_PORT scripts/seaweedfs.sh start | tail -1)
$DOCKER rm -f "$NAME" >/dev/null 2>&1 || true
$DOCKER run -d --name "$NAME" --network host \
  -e TENSORGATE_LISTEN=127.0.0.1:$S3_PORT -e TENSORGATE_ADMIN_LISTEN=127.0.0.1:$ADMIN_PORT \
  -e TENSORGATE_BACKEND_ENDPOINT="$seaweed" -e TENSORGATE_BACKEND_ACCESS_KEY=seaweed-ak \
  -e TENSORGATE_BACKEND_SECRET_KEY=seaweed-sk -e TENSORGATE_ACCESS_KEY=ct-ak -e TENSORGATE_SECRET_KEY=ct-sk \
  tensorgate:test >/dev/null
for _ in $(seq 1 60); do
  [ "$($DOCKER inspect -f '{{.State.Health.Status}}' "$NAME")" = healthy ] && break
  sleep 1
done
health=$($DOCKER inspect -f '{{.State.Health.Status}}' "$NAME")
[ "$health" = healthy ] || { $DOCKER logs "$NAME" | tail -20; echo "container not healthy: $health"; exit 1; }
uid=$($DOCKER exec "$NAME" id -u)
[ "$uid" = 10001 ] || { echo "runs as uid $uid, not the tensorgate user"; exit 1; }
echo "healthy, uid $uid"
CONTAINER_ENDPOINT=http://127.0.0.1:$S3_PORT CONTAINER_SEAWEED="$seaweed" TENSORGATE_BIN="$PWD/target/$PROFILE/tensorgate" \
  .venv/bin/python -m pytest -q tests/container
