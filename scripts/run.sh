#!/usr/bin/env bash
# Runs the gateway on its embedded default (the README's first command): installs only what
# serving needs (`scripts/setup.sh serve`: ONNX Runtime for pushdown from the onnxruntime wheel in
# ./.venv, nasm for SIMD JPEG decoding), then starts tensorgate from the release build. Extra
# arguments go to `tensorgate`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh serve >/dev/null
exec cargo run --release --locked --quiet -- "$@"
