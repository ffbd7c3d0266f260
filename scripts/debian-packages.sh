#!/usr/bin/env bash
# Installs Debian packages for the test stores without starting their services, when any of the
# given commands is missing. Sourced by scripts/ceph-rgw.sh and scripts/swift.sh:
#   ensure_debian_packages "cmd1 cmd2 ..." "pkg1 pkg2 ..." NAME
# Needs root; retries once after `apt-get update`. A policy-rc.d that refuses service starts is
# in place during the install and the previous one (if any) restored afterwards.
ensure_debian_packages() {
  local bins=$1 pkgs=$2 name=$3 b missing=
  for b in $bins; do command -v "$b" >/dev/null || missing=1; done
  [ -z "$missing" ] && return 0
  [ "$(id -u)" = 0 ] || { echo "$name: packages missing ($pkgs); run '$name install' as root" >&2; return 1; }
  local prc=/usr/sbin/policy-rc.d saved= rc=0
  if [ -e "$prc" ]; then saved=$(mktemp); cp -p "$prc" "$saved"; fi
  printf '#!/bin/sh\nexit 101\n' > "$prc"; chmod 755 "$prc"
  { DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs ||
    { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $pkgs; }
  } >&2 || rc=$?
  if [ -n "$saved" ]; then mv "$saved" "$prc"; else rm -f "$prc"; fi
  return $rc
}
