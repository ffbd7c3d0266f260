#!/usr/bin/env bash
# Short benchmarks whose ratios every CI log shows: passthrough pinned (the gateway on its own
# core, 1 round of bench/passthrough.sh) and pushdown on ResNet-18 (16 images, bench/pushdown.py).
# Informational: the ratios are printed, never asserted (the machine is noisy; docs/BENCHMARKS.md
# has the real runs), and a failure here is reported without failing CI.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
echo "== bench smoke: passthrough (pinned, ROUNDS=1)"
ROUNDS=1 bench/passthrough.sh 2>&1 | grep -v '^round ' || status=1
echo "== bench smoke: pushdown (ResNet-18, 16 images, release build)"
{ cargo build --release --locked --quiet --bin tensorgate && scripts/models.sh >/dev/null &&
  BENCH_MODELS=resnet18 N_IMAGES=16 .venv/bin/python bench/pushdown.py; } || status=1
[ "$status" = 0 ] || echo "bench smoke: a benchmark failed (reported, not a test failure)"
exit 0
