#!/usr/bin/env bash
# Runs the gateway on its embedded default (the README's first command): installs the project's
# tools once (scripts/setup.sh: ONNX Runtime for pushdown comes from the onnxruntime wheel in
# ./.venv), then starts tensorgate from the release build. Extra arguments go to `tensorgate`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
exec cargo run --release --locked --quiet -- "$@"
