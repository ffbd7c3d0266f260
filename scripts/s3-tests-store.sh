#!/usr/bin/env bash
# One Ceph s3-tests run (scripts/s3-tests.sh) against a fresh store, bare or through the gateway,
# with the settings docs/COMPATIBILITY.md reports: the store restarted empty, the gateway (release
# build) with allow_anonymous = true (the suite reads public objects anonymously), the store's key
# pair as its one client credential, and backend.trailing_checksums true for SeaweedFS only.
#   scripts/s3-tests-store.sh S3TESTS_DIR STORE MODE OUT_DIR
#     STORE: seaweedfs | ceph-rgw | swift     MODE: bare | gateway | transparent
#   transparent: the gateway in transparent identity mode (no keys at all: ADR 0013).
#   S3T_WITH_ALT=1: the suite's second user is the store's second user (the store scripts make
#     one), so the multi-user and bucket-policy tests run, and on Ceph RGW its tenant user too (the
#     tenant tests); in gateway (terminating) mode every user is a client credential of the
#     gateway, each with its own store key.
#   then: scripts/s3-tests.sh --compare OUT_OF_BARE OUT_OF_GATEWAY
# Per store: Swift's bare run gets S3T_DELETE_OBJECTS_MD5=1 (its s3api refuses the suite's own
# cleanup otherwise; the gateway run uses stock boto3, since the gateway adds the header);
# RGW's runs leave out test_upload_part_copy_percent_encoded_key (it crashes radosgw 16.2.15).
# Ports: the stores' own defaults moved out of the test suites' way (SeaweedFS 18933, RGW 20033,
# Swift 19833); the gateway on 127.0.0.1:19933 (admin 19934).
set -euo pipefail
ORIG=$PWD
cd "$(dirname "$0")/.."
[ $# = 4 ] || { sed -n '6,8p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
SUITE=$1; STORE=$2; MODE=$3; OUT=$4
case "$SUITE" in /*) ;; *) SUITE=$ORIG/$SUITE ;; esac
case "$OUT" in /*) ;; *) OUT=$ORIG/$OUT ;; esac
GW=127.0.0.1:19933
ADMIN=127.0.0.1:19934
TRAILING=false
EXTRA=()
case "$STORE" in
  seaweedfs) export SEAWEED_PORT=18933; AK=seaweed-ak; SK=seaweed-sk; TRAILING=true
    ALT_AK=seaweed-alt-ak; ALT_SK=seaweed-alt-sk ;;
  ceph-rgw) export RGW_PORT=20033; AK=rgw-ak; SK=rgw-sk; ALT_AK=rgw-alt-ak; ALT_SK=rgw-alt-sk
    TENANT_AK=rgw-tenant-ak; TENANT_SK=rgw-tenant-sk
    EXTRA=(--deselect s3tests/functional/test_s3.py::test_upload_part_copy_percent_encoded_key) ;;
  swift) export SWIFT_PORT=19833; AK=test:tester; SK=testing; ALT_AK=test2:tester2; ALT_SK=testing2
    [ "$MODE" = bare ] && export S3T_DELETE_OBJECTS_MD5=1 ;;
  *) echo "s3-tests-store.sh: unknown store $STORE" >&2; exit 2 ;;
esac
case "$MODE" in bare|gateway|transparent) ;; *) echo "s3-tests-store.sh: MODE is bare, gateway or transparent" >&2; exit 2 ;; esac
if [ "${S3T_WITH_ALT:-0}" = 1 ]; then
  export S3T_ALT_ACCESS_KEY=$ALT_AK S3T_ALT_SECRET_KEY=$ALT_SK
  if [ -n "${TENANT_AK:-}" ]; then export S3T_TENANT_ACCESS_KEY=$TENANT_AK S3T_TENANT_SECRET_KEY=$TENANT_SK; fi
fi

GW_PID=
cleanup() {
  [ -n "$GW_PID" ] && kill "$GW_PID" 2>/dev/null || true
  "scripts/$STORE.sh" stop >/dev/null 2>&1 || true
}
trap cleanup EXIT
"scripts/$STORE.sh" stop >/dev/null 2>&1 || true
ENDPOINT=$("scripts/$STORE.sh" start)
if [ "$MODE" != bare ]; then
  cargo build --release --locked --quiet --bin tensorgate
  mkdir -p "$OUT"
  if [ "$MODE" = transparent ]; then
    KEYS=(--backend-identity transparent)
  elif [ "${S3T_WITH_ALT:-0}" = 1 ]; then
    cat > "$OUT/gateway.toml" <<TOML
[[credentials]]
access_key = "$AK"
secret_key = "$SK"
store_access_key = "$AK"
store_secret_key = "$SK"
[[credentials]]
access_key = "$ALT_AK"
secret_key = "$ALT_SK"
store_access_key = "$ALT_AK"
store_secret_key = "$ALT_SK"
TOML
    if [ -n "${TENANT_AK:-}" ]; then
      printf '[[credentials]]\naccess_key = "%s"\nsecret_key = "%s"\nstore_access_key = "%s"\nstore_secret_key = "%s"\n' \
        "$TENANT_AK" "$TENANT_SK" "$TENANT_AK" "$TENANT_SK" >> "$OUT/gateway.toml"
    fi
    KEYS=(--config "$OUT/gateway.toml" --allow-anonymous true --backend-trailing-checksums "$TRAILING")
  else
    KEYS=(--allow-anonymous true --backend-access-key "$AK" --backend-secret-key "$SK"
      --backend-trailing-checksums "$TRAILING" --access-key "$AK" --secret-key "$SK")
  fi
  target/release/tensorgate serve --listen "$GW" --admin-listen "$ADMIN" --backend-endpoint "$ENDPOINT" \
    "${KEYS[@]}" --log warn > "$OUT/gateway.log" 2>&1 &
  GW_PID=$!
  for _ in $(seq 1 100); do curl -sf "http://$ADMIN/readyz" >/dev/null && break; sleep 0.1; done
  ENDPOINT=http://$GW
fi
S3T_ACCESS_KEY=$AK S3T_SECRET_KEY=$SK S3T_EXTRA_ARGS="${EXTRA[*]}" \
  scripts/s3-tests.sh "$SUITE" "$ENDPOINT" "$OUT"
if [ -n "$GW_PID" ] && ! kill -0 "$GW_PID" 2>/dev/null; then
  echo "s3-tests-store.sh: the gateway exited during the run; see $OUT/gateway.log" >&2; exit 1
fi
