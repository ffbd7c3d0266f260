#!/usr/bin/env bash
# Short benchmarks whose ratios every CI log shows: passthrough pinned (the gateway on its own
# core, 1 round of bench/passthrough.sh, with the nginx anchor), pushdown on ResNet-18 (16 images,
# bench/pushdown.py, with the one-core floor; again with pushdown.ort_arena "per-run" and "kept",
# and five engines' memory in each of the three arena modes) and the cluster topology at its smallest
# (bench/cluster/run.py, 3 nodes, 6 shards).
# Informational: the ratios are printed, never asserted (the machine is noisy; docs/BENCHMARKS.md
# has the real runs), and a failure here is reported without failing CI.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
echo "== bench smoke: passthrough (pinned, ROUNDS=1)"
ROUNDS=1 timeout 1200 bench/passthrough.sh 2>&1 | grep -v '^round ' || status=1
echo "== bench smoke: pushdown (ResNet-18, 16 images, release build)"
{ cargo build --release --locked --quiet --bin tensorgate && scripts/models.sh >/dev/null &&
  BENCH_MODELS=resnet18 N_IMAGES=16 .venv/bin/python bench/pushdown.py; } || status=1
echo "== bench smoke: the same with pushdown.ort_arena \"per-run\" (ADR 0012), \"kept\" (ADR 0011), and their memory"
ORT_ARENA=per-run BENCH_MODELS=resnet18 N_IMAGES=16 timeout 600 .venv/bin/python bench/pushdown.py | sed -n '/^(d)/,$p' || status=1
ORT_ARENA=1 BENCH_MODELS=resnet18 N_IMAGES=16 timeout 600 .venv/bin/python bench/pushdown.py | sed -n '/^(d)/,$p' || status=1
TENSORGATE_BIN=target/release/tensorgate timeout 600 .venv/bin/python bench/engine_memory.py || status=1
echo "== bench smoke: cluster (3 nodes behind 25 Mbit/s links, 6 shards; needs root for namespaces)"
if bench/cluster/topology.sh check 2>/dev/null; then
  timeout 600 .venv/bin/python bench/cluster/run.py --nodes 3 --shards 6 --per-shard 4 --out .tmp/cluster-smoke.jsonl \
    | sed -n '/^| nodes/,$p' || status=1
else
  echo "(skipped: no root or no iproute2)"
fi
[ "$status" = 0 ] || echo "bench smoke: a benchmark failed (reported, not a test failure)"
exit 0
