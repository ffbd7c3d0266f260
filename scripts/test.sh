#!/usr/bin/env bash
# The whole test suite, as CI runs it (the README's test command):
#   format and lint checks, Rust unit tests, end-to-end tests against a real SeaweedFS with the real
#   aws-sdk-s3, and the Python client smoke tests (boto3, aws CLI, rclone, s3cmd) against the binary.
# Installs what it needs first (scripts/setup.sh); stops every server it started, even on failure.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}

cleanup() {
  for p in 18433 18533 18633; do SEAWEED_PORT=$p scripts/seaweedfs.sh stop >/dev/null 2>&1 || true; done
}
trap cleanup EXIT

echo "== setup"
scripts/setup.sh

echo "== fmt, clippy"
cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings

echo "== config check"
cargo run --quiet --locked -- check-config config/example.toml

echo "== rust tests (unit + end-to-end against SeaweedFS)"
if command -v cargo-nextest >/dev/null; then
  cargo nextest run --workspace --locked --no-fail-fast
else
  cargo test --workspace --locked --no-fail-fast
fi

echo "== python tests: S3 clients (boto3, aws CLI, rclone, s3cmd), ONNX prefix cut vs onnxruntime"
cargo build --quiet --locked --bin tensorgate
scripts/models.sh
.venv/bin/python -m pytest -q tests/python
