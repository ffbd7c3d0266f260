#!/usr/bin/env bash
# Fuzzing with AFL++ (through cargo-afl) of the parsers in fuzz/src/lib.rs.
#   scripts/fuzz.sh smoke [SECONDS]      # build, replay corpora and regressions, then every target
#                                        # for SECONDS (default 12) from its corpus: fails on any crash
#                                        # or hang. CI runs this (14 targets x 8 s).
#   scripts/fuzz.sh run TARGET SECONDS   # one campaign; findings in .tmp/fuzz/TARGET/default/
#   scripts/fuzz.sh stats                # executions, paths, crashes and hangs of the last runs
#   scripts/fuzz.sh list                 # the targets
# A crash found: copy it from .tmp/fuzz/TARGET/default/crashes/ to fuzz/regressions/TARGET/ (the
# corpus replay test keeps it fixed) and fix the parser. Campaign figures go to docs/RELIABILITY.md.
# Needs cargo-afl (installed here on first use: `cargo install cargo-afl`, which builds AFL++).
set -euo pipefail
cd "$(dirname "$0")/.."
AFL_VERSION=0.18.2
TARGETS=(sigv4 aws_chunked route spec shard parquet npy image disk_entry prefix post_form fs_listing text alias_listing)
# Each input gets this long (ms) before AFL counts it as a hang: every input must be answered
# within a second.
HANG_MS=1000

ensure_afl() {
  if ! cargo afl --version 2>/dev/null | grep -q "$AFL_VERSION"; then
    cargo install --locked --quiet cargo-afl --version "$AFL_VERSION"
  fi
}

build() {
  ensure_afl
  (cd fuzz && cargo afl build --release --locked --quiet)
}

run_target() {  # TARGET SECONDS
  local t=$1 secs=$2 out=.tmp/fuzz/$1
  mkdir -p "$out"
  # No UI, no CPU binding (the machine is shared), no core-dump or CPU-governor checks (containers).
  # No backtraces: a panic is a crash either way, and symbolizing one takes long enough to be
  # counted as a hang.
  RUST_BACKTRACE=0 AFL_NO_UI=1 AFL_NO_AFFINITY=1 AFL_SKIP_CPUFREQ=1 AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES=1 \
    AFL_SKIP_CRASHES=0 AFL_NO_WARN_INSTABILITY=1 \
    cargo afl fuzz -i "fuzz/corpus/$t" -o "$out" -V "$secs" -t "$HANG_MS" -m none -- "fuzz/target/release/$t" \
    > "$out/afl.log" 2>&1 || { echo "fuzz.sh: afl-fuzz failed for $t; see $out/afl.log" >&2; tail -20 "$out/afl.log" >&2; return 1; }
}

stat() {  # TARGET FIELD
  sed -n "s/^$2 *: *//p" ".tmp/fuzz/$1/default/fuzzer_stats" 2>/dev/null || echo "?"
}

stats() {
  printf '| target | executions | seconds | corpus | crashes | hangs |\n|---|---|---|---|---|---|\n'
  for t in "${TARGETS[@]}"; do
    [ -f ".tmp/fuzz/$t/default/fuzzer_stats" ] || continue
    printf '| %s | %s | %s | %s | %s | %s |\n' "$t" "$(stat "$t" execs_done)" "$(stat "$t" run_time)" \
      "$(stat "$t" corpus_count)" "$(stat "$t" saved_crashes)" "$(stat "$t" saved_hangs)"
  done
}

case "${1:-}" in
  smoke)
    secs=${2:-12}
    build
    # The replay test alone: the targets' own test harnesses (no tests in them) would link 14 more
    # instrumented binaries, minutes on two cores.
    (cd fuzz && cargo afl test --release --locked --quiet --test corpus)
    rm -rf .tmp/fuzz
    bad=0
    for t in "${TARGETS[@]}"; do
      run_target "$t" "$secs"
      c=$(stat "$t" saved_crashes); h=$(stat "$t" saved_hangs)
      if [ "$c" != 0 ] || [ "$h" != 0 ]; then
        echo "fuzz.sh: $t: $c crashes, $h hangs in .tmp/fuzz/$t/default/" >&2; bad=1
      fi
    done
    stats
    exit $bad ;;
  run)
    [ $# = 3 ] || { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
    build
    rm -rf ".tmp/fuzz/$2"
    run_target "$2" "$3"
    stats | grep -E "^\| ($2|target|---)" ;;
  stats) stats ;;
  list) printf '%s\n' "${TARGETS[@]}" ;;
  *) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
esac
