#!/usr/bin/env bash
# The whole test suite, as CI runs it (the README's test command):
#   format and lint checks, Rust unit tests, end-to-end tests against a real SeaweedFS with the real
#   aws-sdk-s3, and the Python client smoke tests (boto3, aws CLI, rclone, s3cmd) against the binary;
#   then the store-facing end-to-end tests and the client tests again in front of Ceph RGW 16.2 and
#   OpenStack Swift 2.30 (s3api), each started by its script (installed from Debian when missing);
#   last a fuzz smoke: every AFL++ target of fuzz/ for FUZZ_SECONDS (default 8) from its corpus,
#   after the corpora and the crashes found so far are replayed (scripts/fuzz.sh).
# Installs what it needs first (scripts/setup.sh); stops every server it started, even on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

# Per-phase wall times, printed as each phase ends and together at exit (CI's log shows where its
# minutes go, failed runs included).
timings=() current="" last=$(date +%s)
phase() {
  local now; now=$(date +%s)
  if [ -n "$current" ]; then
    timings+=("$(printf '%6d s  %s' $((now - last)) "$current")")
    echo "   ($current: $((now - last)) s)"
  fi
  current=$1 last=$now
  [ -z "$1" ] || echo "== $1 ($(df -h --output=avail . | tail -1 | tr -d ' ') disk free)"
}

cleanup() {
  phase ""
  printf '== phase times (scripts/test.sh)\n'; printf '%s\n' "${timings[@]}"
  for p in 18433 18533 18633; do SEAWEED_PORT=$p scripts/seaweedfs.sh stop >/dev/null 2>&1 || true; done
  RGW_PORT=19533 scripts/ceph-rgw.sh stop >/dev/null 2>&1 || true
  SWIFT_PORT=19633 scripts/swift.sh stop >/dev/null 2>&1 || true
}
trap cleanup EXIT

# The edge tests hold 2,000 connections from both ends in one process.
ulimit -n 16384 2>/dev/null || ulimit -n "$(ulimit -Hn)" || true

phase "setup"
scripts/setup.sh

phase "fmt, clippy"
cargo fmt --all -- --check
(cd fuzz && cargo fmt -- --check)
cargo clippy --workspace --all-targets --locked -- -D warnings
python3 scripts/import-cycles.py

# One build of every test target and binary, with the workspace's features unified: the config
# check, the test phases, the client tests and the container then reuse it (a `cargo run` or a `-p`
# of one package resolves other features and built the dependencies again: minutes on two cores).
phase "build, config check"
cargo test --workspace --locked --no-run --quiet
cargo build --workspace --locked --bins --quiet
target/debug/tensorgate check-config config/example.toml

phase "rust tests (unit + end-to-end against SeaweedFS)"
if command -v cargo-nextest >/dev/null; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi

phase "python tests: client units (no store), S3 clients (boto3, aws CLI, rclone, s3cmd), ONNX prefix cut vs onnxruntime"
.venv/bin/python -m pytest -q clients/python/tests
cargo build --workspace --locked --bins --quiet
scripts/models.sh
.venv/bin/python -m pytest -q tests/python

# The same store-facing tests on the other stores: what passes on SeaweedFS alone is not verified
# (SeaweedFS accepts requests that RGW and AWS refuse). The suites above ran everything on
# SeaweedFS; here the passthrough and auth end-to-end tests, the real-client tests, the models
# store (a cluster's models as a bucket of the store), alias endpoints and the no-downtime load run
# again.
for store in ceph-rgw swift; do
  phase "store: $store (passthrough and auth end-to-end tests, real clients, the models store)"
  case $store in
    ceph-rgw) RGW_PORT=19533 scripts/ceph-rgw.sh start ;;
    swift) SWIFT_PORT=19633 scripts/swift.sh start ;;
  esac
  if command -v cargo-nextest >/dev/null; then
    TENSORGATE_IT_STORE=$store cargo nextest run --workspace --locked --no-fail-fast \
      -E 'package(integration-tests) & test(/^(passthrough|auth|transparent)::/)'
  else
    TENSORGATE_IT_STORE=$store cargo test -p integration-tests --locked --no-fail-fast -- passthrough:: auth:: transparent::
  fi
  # The no-downtime load runs 60 s on SeaweedFS above; here its same events within 30 s of load.
  TENSORGATE_NO_DOWNTIME_SECS=30 TENSORGATE_TEST_STORE=$store .venv/bin/python -m pytest -q \
    tests/python/test_s3_clients.py tests/python/test_identity.py tests/python/test_alias_endpoints.py \
    tests/python/test_models_store.py tests/python/test_augment.py \
    tests/python/test_no_downtime.py
done

# Transparent identity mode (ADR 0013): the real-client tests again, signed with each store's own
# user keys, the gateway holding none (test_identity.py ran per store above).
for store in seaweedfs ceph-rgw swift; do
  phase "transparent identity: $store (real clients with the store's own keys)"
  TENSORGATE_TEST_IDENTITY=transparent TENSORGATE_TEST_STORE=$store .venv/bin/python -m pytest -q tests/python/test_s3_clients.py
done

phase "store: fs (the embedded backend; real clients)"
TENSORGATE_TEST_STORE=fs .venv/bin/python -m pytest -q tests/python/test_s3_clients.py

phase "fuzz smoke (AFL++ through cargo-afl; scripts/fuzz.sh)"
scripts/fuzz.sh smoke "${FUZZ_SECONDS:-8}"
