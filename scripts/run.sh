#!/usr/bin/env bash
# Runs the gateway on its embedded default (the README's first command): installs only what
# serving needs (`scripts/setup.sh serve`: ONNX Runtime for pushdown from the onnxruntime wheel in
# ./.venv, nasm for SIMD JPEG decoding), then starts tensorgate from the release build. Extra
# arguments go to `tensorgate`.
set -euo pipefail
cd "$(dirname "$0")/.."
# nasm before the build (libjpeg-turbo's SIMD is assembled during it); ONNX Runtime while it
# runs, since serving is the first thing that needs it.
scripts/setup.sh serve-tools >/dev/null
scripts/setup.sh serve-python >/dev/null &
python=$!
cargo build --release --locked --quiet
wait "$python"
exec cargo run --release --locked --quiet -- "$@"
