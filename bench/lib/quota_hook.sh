#!/usr/bin/env bash
# KINDS_HOOK for s3bench under bench/request_kinds.sh with PROXY_QUOTA: `quota_hook.sh CGROUP
# OUT NAME ROUND before|after KIND` appends, after each phase, one JSON line to OUT with the
# phase's CFS periods and how many of them the proxy's cgroup was throttled in (from its
# cpu.stat: `nr_periods`/`nr_throttled` in cgroup v1 and v2 alike). The count before a phase
# waits in OUT.NAME.KIND (a cgroup's directory takes no files).
set -euo pipefail
cg=$1 out=$2 name=$3 round=$4 when=$5 kind=$6
stat() { awk '$1 == "nr_periods" {p = $2} $1 == "nr_throttled" {t = $2} END {print p + 0, t + 0}' "$cg/cpu.stat"; }
case $when in
  before) stat > "$out.$name.$kind" ;;
  after)
    read -r p0 t0 < "$out.$name.$kind"; read -r p1 t1 < <(stat); rm -f "$out.$name.$kind"
    echo "{\"label\":\"$name\",\"test\":\"quota\",\"round\":$round,\"kind\":\"$kind\",\"periods\":$(( p1 - p0 )),\"throttled\":$(( t1 - t0 ))}" >> "$out" ;;
esac
