#!/usr/bin/env bash
# KINDS_HOOK for s3bench under bench/request_instructions.sh: `callgrind_hook.sh ADMIN DIR NAME
# before|after KIND`. The gateway runs under callgrind with its counts zeroed when `/readyz` is
# served (its `Registry::digest`) and dumped when `/metrics` is (`Metrics::render`), by
# `--zero-before` and `--dump-before`: asking for one before a phase and the other after it
# leaves the phase's counts in a dump, moved to DIR/NAME-KIND.cg.
set -euo pipefail
admin=$1 dir=$2 name=$3 when=$4 kind=$5
case $when in
  before) curl -sf "http://$admin/readyz" >/dev/null ;;
  after)
    curl -sf "http://$admin/metrics" >/dev/null
    # callgrind names each dump OUTFILE.N, written before the answer: the newest is this phase's.
    latest=$(ls -t "$dir"/callgrind.out.*.* | head -1)
    mv "$latest" "$dir/$name-$kind.cg" ;;
esac
