#!/usr/bin/env bash
# Starts or stops a throwaway single-node Ceph RGW (Debian packages radosgw, ceph-mon, ceph-osd,
# ceph-common; Ceph 16 "pacific" on Debian 12). One monitor, one memstore OSD (data in RAM, no
# block device), no mgr, one radosgw with the beast frontend. Loopback only, auth none (no cephx).
#   scripts/ceph-rgw.sh start     # prints the endpoint; everything under .tmp/ceph-rgw-$PORT
#   scripts/ceph-rgw.sh stop
#   scripts/ceph-rgw.sh install   # as root: apt-get installs the packages (start does it if missing)
# Env: RGW_PORT (S3 port, default 19533). The monitor listens on PORT+7 (msgr v2 only; msgr v1 is
#      off), the OSD binds in PORT+10..PORT+29 (it takes 4 of them).
#      RGW_ACCESS_KEY / RGW_SECRET_KEY (default rgw-ak / rgw-sk): user "tester";
#      RGW_ALT_ACCESS_KEY / RGW_ALT_SECRET_KEY (default rgw-alt-ak / rgw-alt-sk): user "alt".
#      RGW_TENANT_ACCESS_KEY / RGW_TENANT_SECRET_KEY (default rgw-tenant-ak / rgw-tenant-sk): user
#        "s3t$tenanted", of tenant "s3t" (its buckets are not in the default tenant's namespace).
#      RGW_DOMAIN (default localhost): virtual-host addressing, a Host of <bucket>.<domain>.
#      STS is on (rgw sts key), and "tester" may manage roles, so tests can assume one.
# Every start wipes the state: buckets and users do not survive a stop.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${RGW_PORT:-19533}
AK=${RGW_ACCESS_KEY:-rgw-ak}
SK=${RGW_SECRET_KEY:-rgw-sk}
ALT_AK=${RGW_ALT_ACCESS_KEY:-rgw-alt-ak}
ALT_SK=${RGW_ALT_SECRET_KEY:-rgw-alt-sk}
TENANT_AK=${RGW_TENANT_ACCESS_KEY:-rgw-tenant-ak}
TENANT_SK=${RGW_TENANT_SECRET_KEY:-rgw-tenant-sk}
MON_PORT=$((PORT+7))
DIR=$PWD/.tmp/ceph-rgw-$PORT
CONF=$DIR/ceph.conf
DAEMONS="radosgw osd mon"   # stop order
mkdir -p .tmp
# Serialize concurrent starts/stops (tests run in parallel processes).
exec 9>".tmp/ceph-rgw-$PORT.lock"
flock 9

# shellcheck source=debian-packages.sh
. scripts/debian-packages.sh
install_pkgs() {
  ensure_debian_packages "radosgw radosgw-admin ceph-mon ceph-osd ceph monmaptool" \
    "radosgw ceph-mon ceph-osd ceph-common" ceph-rgw.sh
}

running() { [ -f "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

stop_all() {
  local d pid
  for d in $DAEMONS; do
    [ -f "$DIR/$d.pid" ] || continue
    pid=$(cat "$DIR/$d.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$DIR/$d.pid"
  done
}

fail() {
  echo "ceph-rgw.sh: $1; logs: $DIR/log" >&2
  local f
  for f in "$DIR"/log/*.log; do [ -f "$f" ] && { echo "== $f" >&2; tail -20 "$f" >&2; }; done
  stop_all
  exit 1
}

# Runs a daemon in the foreground under nohup, recording its pid as $DIR/$1.pid.
spawn() {
  local name=$1; shift
  nohup "$@" -f -c "$CONF" > "$DIR/log/$name.out" 2>&1 9>&- &
  echo $! > "$DIR/$name.pid"
}

ceph_cli() { timeout 60 ceph -c "$CONF" "$@"; }

case "${1:-start}" in
  install) install_pkgs ;;
  start)
    install_pkgs
    if running radosgw && running osd && running mon; then echo "http://127.0.0.1:$PORT"; exit 0; fi
    stop_all
    for p in "$PORT" "$MON_PORT"; do
      if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then
        echo "ceph-rgw.sh: 127.0.0.1:$p is already in use by something else" >&2; exit 1
      fi
    done
    rm -rf "$DIR"; mkdir -p "$DIR"/{log,run,mon/a,osd/0,rgw,crash}
    fsid=$(cat /proc/sys/kernel/random/uuid)
    cat > "$CONF" <<CONF
[global]
fsid = $fsid
mon host = [v2:127.0.0.1:$MON_PORT]
mon initial members = a
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind msgr1 = false
ms bind ipv6 = false
ms bind port min = $((PORT+10))
ms bind port max = $((PORT+29))
auth cluster required = none
auth service required = none
auth client required = none
# With auth none only crc mode is possible; radosgw otherwise asks for "secure" towards the mon.
ms mon client mode = crc
keyring = $DIR/keyring
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
mon cluster log file = $DIR/log/cluster.log
crash dir = $DIR/crash
log to stderr = false
err to stderr = true
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim = false
mon warn on insecure global id reclaim allowed = false
mon max pg per osd = 1000
mon data avail warn = 2
mon data avail crit = 1
[mon]
mon data = $DIR/mon/\$id
[osd]
osd data = $DIR/osd/\$id
osd objectstore = memstore
memstore device bytes = $((3 << 30))
osd crush update on start = true
[client.rgw.a]
rgw data = $DIR/rgw
rgw frontends = beast endpoint=127.0.0.1:$PORT
rgw crypt require ssl = false
# Virtual-host addressing: a Host of <bucket>.<domain> (path style keeps working).
rgw dns name = ${RGW_DOMAIN:-localhost}
# STS (AssumeRole, temporary credentials with a session token): the tests' session users.
rgw sts key = tensorgatestskey
rgw s3 auth use sts = true
CONF
    # Monitor.
    monmaptool --create --fsid "$fsid" --addv a "[v2:127.0.0.1:$MON_PORT]" --enable-all-features \
      --set-min-mon-release pacific "$DIR/monmap" > "$DIR/log/mkfs.out" 2>&1 || fail "monmaptool failed"
    ceph-mon -c "$CONF" --mkfs -i a --monmap "$DIR/monmap" >> "$DIR/log/mkfs.out" 2>&1 || fail "ceph-mon --mkfs failed"
    spawn mon ceph-mon -i a
    # OSD: register it with the monitor, make its (in-memory) store, start it.
    osd_uuid=$(cat /proc/sys/kernel/random/uuid)
    osd_id=$(ceph_cli osd new "$osd_uuid" 2>> "$DIR/log/mkfs.out") || fail "ceph osd new failed"
    [ "$osd_id" = 0 ] || fail "unexpected osd id '$osd_id'"
    ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$osd_uuid" >> "$DIR/log/mkfs.out" 2>&1 || fail "ceph-osd --mkfs failed"
    spawn osd ceph-osd -i 0
    # Users (radosgw-admin also makes the realm/zone pools; it waits for the OSD to come up).
    timeout 120 radosgw-admin -c "$CONF" user create --uid tester --display-name tester \
      --email tester@example.com --access-key "$AK" --secret-key "$SK" >> "$DIR/log/mkfs.out" 2>&1 ||
      fail "radosgw-admin user create tester failed"
    timeout 60 radosgw-admin -c "$CONF" user create --uid alt --display-name alt \
      --email alt@example.com --access-key "$ALT_AK" --secret-key "$ALT_SK" >> "$DIR/log/mkfs.out" 2>&1 ||
      fail "radosgw-admin user create alt failed"
    timeout 60 radosgw-admin -c "$CONF" user create --tenant s3t --uid tenanted --display-name tenanted \
      --email tenanted@example.com --access-key "$TENANT_AK" --secret-key "$TENANT_SK" >> "$DIR/log/mkfs.out" 2>&1 ||
      fail "radosgw-admin user create s3t\$tenanted failed"
    # The main user may manage roles (IAM CreateRole/PutRolePolicy), so a test can make one to
    # assume through STS.
    timeout 60 radosgw-admin -c "$CONF" caps add --uid tester --caps "roles=*" >> "$DIR/log/mkfs.out" 2>&1 ||
      fail "radosgw-admin caps add failed"
    spawn radosgw radosgw -n client.rgw.a
    for _ in $(seq 1 240); do
      # Ready when a signed ListBuckets succeeds (S3 API, auth and RADOS behind it all up). curl 7.88
      # signs without sending x-amz-content-sha256, which RGW then takes as UNSIGNED-PAYLOAD: say so.
      code=$(curl -s --max-time 5 -o /dev/null -w '%{http_code}' --aws-sigv4 "aws:amz:us-east-1:s3" --user "$AK:$SK" \
        -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "http://127.0.0.1:$PORT/" || true)
      if [ "$code" = 200 ]; then echo "http://127.0.0.1:$PORT"; exit 0; fi
      for d in $DAEMONS; do running "$d" || fail "$d exited"; done
      sleep 0.5
    done
    fail "RGW did not answer a signed ListBuckets with 200 within 120 s"
    ;;
  stop) stop_all ;;
  *) echo "usage: $0 start|stop|install" >&2; exit 2 ;;
esac
