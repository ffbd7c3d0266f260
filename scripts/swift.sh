#!/usr/bin/env bash
# Starts or stops a throwaway one-node OpenStack Swift (Debian 12 packages, Swift 2.30) with the
# s3api middleware in front of tempauth. One proxy, one account, one container and one object
# server (each workers = 0: a single process, run in the foreground under nohup with -v so that
# it logs to a file), a private memcached (tempauth needs the cache), one device, one replica.
# Loopback only.
#   scripts/swift.sh start     # prints the endpoint; everything under .tmp/swift-$PORT
#   scripts/swift.sh stop
#   scripts/swift.sh install   # as root: apt-get installs the packages (start does it if missing)
# Env: SWIFT_PORT (proxy = S3 port, default 19633). The account, container and object servers
#      listen on PORT+1, PORT+2, PORT+3, memcached on PORT+4.
#      SWIFT_ACCESS_KEY / SWIFT_SECRET_KEY (default test:tester / testing): tempauth user
#        "tester" of account "test" (AUTH_test), .admin. Tempauth's S3 access keys are always
#        ACCOUNT:USER (letters, digits and '-' only here).
#      SWIFT_ALT_ACCESS_KEY / SWIFT_ALT_SECRET_KEY (default test2:tester2 / testing2): a second
#        .admin user in its own account (AUTH_test2), so it sees none of the first user's buckets.
#      SWIFT_DOMAIN (default localhost): virtual-host addressing, a Host of <bucket>.<domain>.
# Swift reads the hash path prefix/suffix only from /etc/swift/swift.conf: start writes that file
# if it is missing, or adds a [swift-hash] section to it; it never changes existing values.
# A start that finds this instance running leaves it be; any other start wipes the state, so
# buckets do not survive a stop. stop leaves .tmp/swift-$PORT (logs, configs) for a look.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${SWIFT_PORT:-19633}
AK=${SWIFT_ACCESS_KEY:-test:tester}
SK=${SWIFT_SECRET_KEY:-testing}
ALT_AK=${SWIFT_ALT_ACCESS_KEY:-test2:tester2}
ALT_SK=${SWIFT_ALT_SECRET_KEY:-testing2}
DIR=$PWD/.tmp/swift-$PORT   # absolute: the servers chdir to / when they start
SERVERS="proxy account container object"
DAEMONS="proxy object container account memcached"   # stop order
SWIFT_CONF=/etc/swift/swift.conf
mkdir -p .tmp
# Serialize concurrent starts/stops (tests run in parallel processes).
exec 9>".tmp/swift-$PORT.lock"
flock 9

# shellcheck source=debian-packages.sh
. scripts/debian-packages.sh
install_pkgs() {
  ensure_debian_packages "swift-proxy-server swift-account-server swift-container-server swift-object-server swift-ring-builder memcached" \
    "swift swift-proxy swift-account swift-container swift-object memcached" swift.sh
}

# Makes sure /etc/swift/swift.conf has a hash path prefix/suffix (values it has are kept).
ensure_swift_conf() {
  if grep -Eq '^[[:space:]]*swift_hash_path_(prefix|suffix)[[:space:]]*=[[:space:]]*[^[:space:]]' "$SWIFT_CONF" 2>/dev/null; then
    return 0
  fi
  mkdir -p "$(dirname "$SWIFT_CONF")" 2>/dev/null || true
  [ -w "$SWIFT_CONF" ] || { [ ! -e "$SWIFT_CONF" ] && [ -w "$(dirname "$SWIFT_CONF")" ]; } ||
    { echo "swift.sh: $SWIFT_CONF lacks swift_hash_path_prefix/suffix and is not writable" >&2; return 1; }
  if grep -Eq '^[[:space:]]*\[swift-hash\]' "$SWIFT_CONF" 2>/dev/null; then
    sed -i '/^[[:space:]]*\[swift-hash\]/a swift_hash_path_prefix = tensorgate-test\nswift_hash_path_suffix = tensorgate-test' "$SWIFT_CONF"
  else
    printf '\n[swift-hash]\nswift_hash_path_prefix = tensorgate-test\nswift_hash_path_suffix = tensorgate-test\n' >> "$SWIFT_CONF"
  fi
}

# running NAME: its pid file names a live process whose command line mentions this instance.
running() {
  local pid
  [ -f "$DIR/run/$1.pid" ] || return 1
  pid=$(cat "$DIR/run/$1.pid")
  alive "$pid" && grep -qa -- "$DIR\|-p$((PORT+4))" "/proc/$pid/cmdline" 2>/dev/null
}

# alive PID: the process exists and is not a zombie (an orphan's zombie lingers until pid 1
# reaps it, which in some containers takes a second or two).
alive() { kill -0 "$1" 2>/dev/null && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }

# SIGTERM to every daemon of this instance, then up to 10 s for them to exit, then SIGKILL.
stop_all() {
  local d pid pids=
  for d in $DAEMONS; do
    [ -f "$DIR/run/$d.pid" ] || continue
    if running "$d"; then pids="$pids $(cat "$DIR/run/$d.pid")"; fi
    rm -f "$DIR/run/$d.pid"
  done
  [ -n "$pids" ] || return 0
  kill $pids 2>/dev/null || true
  for _ in $(seq 1 50); do
    d=; for pid in $pids; do alive "$pid" && d=1; done
    [ -n "$d" ] || return 0
    sleep 0.2
  done
  kill -9 $pids 2>/dev/null || true
}

fail() {
  echo "swift.sh: $1; logs: $DIR/log" >&2
  local f
  for f in "$DIR"/log/*.log; do [ -f "$f" ] && { echo "== $f" >&2; tail -20 "$f" >&2; }; done
  stop_all
  exit 1
}

# spawn NAME CMD...: runs CMD in the foreground under nohup, pid in $DIR/run/NAME.pid.
# EVENTLET_NO_GREENDNS: skip eventlet's dnspython-based resolver (everything here is a literal
# 127.0.0.1); its import costs about a second per server on a busy 2-core box.
spawn() {
  local name=$1; shift
  EVENTLET_NO_GREENDNS=yes nohup "$@" > "$DIR/log/$name.log" 2>&1 9>&- &
  echo $! > "$DIR/run/$name.pid"
}

# tempauth_user KEY SECRET: the tempauth line for access key ACCOUNT:USER.
tempauth_user() {
  [[ $1 =~ ^([A-Za-z0-9-]+):([A-Za-z0-9-]+)$ ]] ||
    { echo "swift.sh: access key '$1' is not ACCOUNT:USER (letters, digits, '-')" >&2; exit 2; }
  echo "user_${BASH_REMATCH[1]}_${BASH_REMATCH[2]} = $2 .admin"
}

# Ready probe (one try): memcached accepts connections, each backend's /healthcheck says OK and a
# SigV4-signed ListBuckets as the main user gets 200 (proxy, s3api, tempauth, account server).
# Standard library only (no botocore needed), so it runs before scripts/setup.sh made the venv.
READY_PY='
import datetime, hashlib, hmac, socket, sys, urllib.request
port, ak, sk = int(sys.argv[1]), sys.argv[2], sys.argv[3]
socket.create_connection(("127.0.0.1", port + 4), timeout=2).close()
for p in (port + 1, port + 2, port + 3):
    urllib.request.urlopen("http://127.0.0.1:%d/healthcheck" % p, timeout=2).read()
host = "127.0.0.1:%d" % port
now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
empty = hashlib.sha256(b"").hexdigest()
signed = "host;x-amz-content-sha256;x-amz-date"
canonical = "GET\n/\n\nhost:%s\nx-amz-content-sha256:%s\nx-amz-date:%s\n\n%s\n%s" % (
    host, empty, now, signed, empty)
scope = now[:8] + "/us-east-1/s3/aws4_request"
to_sign = "AWS4-HMAC-SHA256\n%s\n%s\n%s" % (now, scope, hashlib.sha256(canonical.encode()).hexdigest())
key = ("AWS4" + sk).encode()
for part in (now[:8], "us-east-1", "s3", "aws4_request"):
    key = hmac.new(key, part.encode(), hashlib.sha256).digest()
sig = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
auth = "AWS4-HMAC-SHA256 Credential=%s/%s, SignedHeaders=%s, Signature=%s" % (ak, scope, signed, sig)
req = urllib.request.Request("http://%s/" % host, headers={
    "x-amz-date": now, "x-amz-content-sha256": empty, "Authorization": auth})
urllib.request.urlopen(req, timeout=5).read()
'
PY=/usr/bin/python3   # the one Swift itself runs on

case "${1:-start}" in
  install) install_pkgs ;;
  start)
    install_pkgs
    all=1; for d in $DAEMONS; do running "$d" || all=; done
    if [ -n "$all" ]; then echo "http://127.0.0.1:$PORT"; exit 0; fi
    stop_all
    ensure_swift_conf
    main_user=$(tempauth_user "$AK" "$SK"); alt_user=$(tempauth_user "$ALT_AK" "$ALT_SK")
    rm -rf "$DIR"; mkdir -p "$DIR"/{log,run,srv/node/d1}
    # Rings: 2^4 partitions, 1 replica, one device, built in one process with Swift's RingBuilder
    # (what swift-ring-builder create/add/rebalance does; nine swift-ring-builder runs cost ~10 s
    # on a busy 2-core box). One object ring per storage policy that swift.conf declares
    # (Debian's has only policy 0).
    policies=$(sed -n 's/^[[:space:]]*\[storage-policy:\([0-9]\+\)\].*/\1/p' "$SWIFT_CONF")
    /usr/bin/python3 - "$DIR" "$PORT" ${policies:-0} > "$DIR/log/rings.log" 2>&1 <<'PY' ||
import sys
from swift.common.ring import RingBuilder
top, port, policies = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rings = [("account", port + 1), ("container", port + 2)]
rings += [("object" if i == "0" else "object-" + i, port + 3) for i in policies]
for name, p in rings:
    b = RingBuilder(4, 1, 0)
    b.add_dev({"region": 1, "zone": 1, "ip": "127.0.0.1", "port": p, "device": "d1",
               "weight": 100.0, "meta": ""})
    b.rebalance(seed=1)
    b.validate()
    b.get_ring().save("%s/%s.ring.gz" % (top, name))
    print("%s.ring.gz: 127.0.0.1:%d/d1" % (name, p))
PY
      fail "building the rings failed"
    common="bind_ip = 127.0.0.1
bind_timeout = 5
workers = 0
user = root
swift_dir = $DIR
log_level = INFO"
    storage="$common
devices = $DIR/srv/node
mount_check = false
disable_fallocate = true"
    cat > "$DIR/proxy-server.conf" <<CONF
[DEFAULT]
bind_port = $PORT
$common

[pipeline:main]
pipeline = catch_errors gatekeeper healthcheck proxy-logging cache listing_formats bulk tempurl ratelimit s3api tempauth copy container-quotas account-quotas slo dlo versioned_writes symlink proxy-logging proxy-server

[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true

[filter:s3api]
use = egg:swift#s3api
location = us-east-1
# Virtual-host addressing: a Host of <bucket>.<domain> (path style keeps working).
storage_domain = ${SWIFT_DOMAIN:-localhost}
s3_acl = false
allow_multipart_uploads = true
# S3's limit (Swift's default is 1000); slo's max_manifest_segments is raised to match.
max_upload_part_num = 10000
force_swift_request_proxy_log = true

[filter:tempauth]
use = egg:swift#tempauth
$main_user
$alt_user

[filter:cache]
use = egg:swift#memcache
memcache_servers = 127.0.0.1:$((PORT+4))

[filter:slo]
use = egg:swift#slo
max_manifest_segments = 10000

[filter:versioned_writes]
use = egg:swift#versioned_writes
allow_versioned_writes = true
allow_object_versioning = true

[filter:catch_errors]
use = egg:swift#catch_errors
[filter:gatekeeper]
use = egg:swift#gatekeeper
[filter:healthcheck]
use = egg:swift#healthcheck
[filter:proxy-logging]
use = egg:swift#proxy_logging
[filter:listing_formats]
use = egg:swift#listing_formats
[filter:bulk]
use = egg:swift#bulk
[filter:tempurl]
use = egg:swift#tempurl
[filter:ratelimit]
use = egg:swift#ratelimit
[filter:copy]
use = egg:swift#copy
[filter:container-quotas]
use = egg:swift#container_quotas
[filter:account-quotas]
use = egg:swift#account_quotas
[filter:dlo]
use = egg:swift#dlo
[filter:symlink]
use = egg:swift#symlink
CONF
    n=1
    for s in account container object; do
      cat > "$DIR/$s-server.conf" <<CONF
[DEFAULT]
bind_port = $((PORT+n))
$storage

[pipeline:main]
pipeline = healthcheck $s-server

[app:$s-server]
use = egg:swift#$s

[filter:healthcheck]
use = egg:swift#healthcheck
CONF
      n=$((n+1))
    done
    spawn memcached memcached -l 127.0.0.1 -p$((PORT+4)) -U 0 -m 64 -c 1024 -u root
    for s in $SERVERS; do spawn "$s" "swift-$s-server" "$DIR/$s-server.conf" -v; done
    for _ in $(seq 1 120); do
      if "$PY" -c "$READY_PY" "$PORT" "$AK" "$SK" 2>/dev/null; then echo "http://127.0.0.1:$PORT"; exit 0; fi
      for d in $DAEMONS; do running "$d" || fail "$d exited"; done
      sleep 0.5
    done
    fail "Swift did not answer a signed ListBuckets with 200 within 60 s"
    ;;
  stop) stop_all ;;
  *) echo "usage: $0 start|stop|install" >&2; exit 2 ;;
esac
