#!/usr/bin/env bash
# Starts or stops a throwaway Prometheus (Debian's `prometheus` 2.42, installed when missing) that
# scrapes tensorgate admin listeners on loopback every second (tests/python/test_monitoring.py).
#   scripts/prometheus.sh start     # prints the URL; config and data under .tmp/prometheus-$PORT
#   scripts/prometheus.sh stop
#   scripts/prometheus.sh install   # as root: apt-get installs prometheus (promtool comes with it);
#                                   # start does it if missing. The packaged service is not started.
# Env: PROM_PORT (HTTP port, default 19090; loopback only),
#      PROM_SCRAPE_PORTS (admin ports of the gateways on 127.0.0.1 to scrape, space- or
#        comma-separated, default 9001) as job "tensorgate", the job the alert rules name,
#      PROM_RULES (optional: a rules file to load, e.g. deploy/prometheus/tensorgate-rules.yml,
#        evaluated every second).
# Every start wipes the previous run's data (a Prometheus already running on the port is stopped
# first, so a start always scrapes the ports it was given).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PROM_PORT:-19090}
TARGETS=${PROM_SCRAPE_PORTS:-9001}
DIR=$PWD/.tmp/prometheus-$PORT
mkdir -p .tmp
# Serialize concurrent starts/stops.
exec 9>".tmp/prometheus-$PORT.lock"
flock 9

# shellcheck source=debian-packages.sh
. scripts/debian-packages.sh
install_pkgs() {
  # --no-install-recommends: no prometheus-node-exporter; the policy-rc.d of
  # ensure_debian_packages keeps the packaged daemon (127.0.0.1:9090) from starting.
  ensure_debian_packages "prometheus promtool" "prometheus" prometheus.sh
}

stop_it() {
  [ -f "$DIR/pid" ] || return 0
  local pid; pid=$(cat "$DIR/pid")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
  kill -9 "$pid" 2>/dev/null || true
  rm -f "$DIR/pid"
}

case "${1:-start}" in
  install) install_pkgs ;;
  start)
    install_pkgs
    stop_it
    if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
      echo "prometheus.sh: 127.0.0.1:$PORT is already in use by something else" >&2; exit 1
    fi
    rm -rf "$DIR"; mkdir -p "$DIR/data"
    targets=""
    for p in ${TARGETS//,/ }; do
      case $p in *[!0-9]* | "") echo "prometheus.sh: PROM_SCRAPE_PORTS takes port numbers, not '$p'" >&2; exit 2 ;; esac
      targets="$targets${targets:+, }'127.0.0.1:$p'"
    done
    rules=""
    if [ -n "${PROM_RULES:-}" ]; then
      rules="rule_files: ['$(realpath "$PROM_RULES")']"
    fi
    cat > "$DIR/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
$rules
scrape_configs:
  - job_name: tensorgate
    static_configs:
      - targets: [$targets]
YAML
    nohup prometheus --config.file="$DIR/prometheus.yml" --storage.tsdb.path="$DIR/data" \
      --web.listen-address="127.0.0.1:$PORT" --log.level=warn > "$DIR/prometheus.log" 2>&1 9>&- &
    echo $! > "$DIR/pid"
    for _ in $(seq 1 120); do
      if ! kill -0 "$(cat "$DIR/pid")" 2>/dev/null; then break; fi
      code=$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/-/ready" || true)
      if [ "$code" = 200 ]; then echo "http://127.0.0.1:$PORT"; exit 0; fi
      sleep 0.25
    done
    echo "prometheus.sh: Prometheus did not come up; log: $DIR/prometheus.log" >&2
    tail -20 "$DIR/prometheus.log" >&2; stop_it; exit 1
    ;;
  stop) stop_it ;;
  *) echo "usage: $0 start|stop|install" >&2; exit 2 ;;
esac
