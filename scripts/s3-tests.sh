#!/usr/bin/env bash
# Runs the Ceph s3-tests suite (https://github.com/ceph/s3-tests, a checkout outside this repo) against
# an S3 endpoint, and compares two runs.
#   scripts/s3-tests.sh S3TESTS_DIR ENDPOINT_URL OUT_DIR   # e.g. /work/s3-tests http://127.0.0.1:18933 .tmp/s3t/x
#   scripts/s3-tests.sh --compare A_DIR B_DIR              # tests passing in A but not B, and the reverse
# Env: S3T_ACCESS_KEY / S3T_SECRET_KEY (main user, required);
#      S3T_ALT_ACCESS_KEY / S3T_ALT_SECRET_KEY (second user; without them the tests that need one are
#        deselected and the suite's alt/tenant sections reuse the main keys, for its bucket cleanup);
#      S3T_TENANT_ACCESS_KEY / S3T_TENANT_SECRET_KEY (a user of tenant S3T_TENANT, default s3t, as
#        Ceph RGW has them, e.g. scripts/ceph-rgw.sh's "s3t$tenanted"; without them the tests that
#        need one are deselected), S3T_TENANT_USER_ID (default: $S3T_TENANT$ + the display name);
#      S3T_DISPLAY_NAME / S3T_EMAIL / S3T_USER_ID (main owner, for tests that check it; by default the
#        owner that ListBuckets reports), S3T_ALT_DISPLAY_NAME / S3T_ALT_EMAIL / S3T_ALT_USER_ID likewise;
#      S3T_MARKEXPR / S3T_KEYWORDS (override the -m / -k selection below), S3T_TIMEOUT (per-test seconds,
#      default 300), S3T_EXTRA_ARGS (more pytest arguments, word-split),
#      S3T_DELETE_OBJECTS_MD5=1 (the suite's DeleteObjects calls get a Content-MD5: botocore >= 1.36
#        no longer sends one and Swift's s3api requires it, so against bare Swift the suite's own
#        bucket cleanup fails without this; docs/compat/swift.md).
# The suite gets its own venv, .tmp/s3tests-venv (its requirements.txt plus pytest-timeout).
# OUT_DIR gets s3tests.conf, selected.txt, pytest.log, junit.xml and sorted passed.txt / failed.txt /
# skipped.txt (pytest node ids, relative to S3TESTS_DIR).
# Selection: the suite's marked features SSE (encryption, sse_s3, bucket_encryption), lifecycle,
# bucket policies (selected when a second user is given), bucket logging and IAM, plus by name object lock and policy_status, plus (found by
# reading the test modules) the tests that need a second user, a tenant user or IAM accounts.
set -euo pipefail
ORIG=$PWD
cd "$(dirname "$0")/.."
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$ORIG/$1" ;; esac; }

if [ "${1:-}" = --compare ]; then
  [ $# = 3 ] || { echo "usage: $0 --compare A_DIR B_DIR" >&2; exit 2; }
  A=$(abspath "$2"); B=$(abspath "$3")
  for f in "$A/passed.txt" "$B/passed.txt"; do [ -f "$f" ] || { echo "s3-tests.sh: $f missing" >&2; exit 1; }; done
  reg=$(LC_ALL=C comm -23 <(LC_ALL=C sort -u "$A/passed.txt") <(LC_ALL=C sort -u "$B/passed.txt"))
  gain=$(LC_ALL=C comm -13 <(LC_ALL=C sort -u "$A/passed.txt") <(LC_ALL=C sort -u "$B/passed.txt"))
  count() { if [ -n "$1" ]; then printf '%s\n' "$1" | wc -l; else echo 0; fi; }
  echo "A: $2 ($(wc -l < "$A/passed.txt") passed)   B: $3 ($(wc -l < "$B/passed.txt") passed)"
  echo "== regressions: pass in A, not in B: $(count "$reg")"
  [ -z "$reg" ] || printf '%s\n' "$reg"
  echo "== pass in B, not in A: $(count "$gain")"
  [ -z "$gain" ] || printf '%s\n' "$gain"
  exit 0
fi

[ $# = 3 ] || { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
SUITE=$(abspath "$1"); ENDPOINT=$2; OUT=$(abspath "$3")
: "${S3T_ACCESS_KEY:?S3T_ACCESS_KEY is required}" "${S3T_SECRET_KEY:?S3T_SECRET_KEY is required}"
[ -f "$SUITE/requirements.txt" ] || { echo "s3-tests.sh: $SUITE is not an s3-tests checkout" >&2; exit 1; }
# The suite's package was s3tests_boto3/ until 2025-09, s3tests/ since.
PKG=s3tests; [ -d "$SUITE/s3tests_boto3/functional" ] && PKG=s3tests_boto3
TESTS="$PKG/functional/test_s3.py $PKG/functional/test_headers.py"

# The suite's venv, made once (again when its requirements.txt changes).
VENV=.tmp/s3tests-venv
PY=$PWD/$VENV/bin/python
stamp="$VENV/.req-$(sha256sum "$SUITE/requirements.txt" | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  mkdir -p .tmp
  [ -x "$PY" ] || python3 -m venv "$VENV"
  "$PY" -m pip install --quiet --disable-pip-version-check -r "$SUITE/requirements.txt" pytest-timeout
  rm -f "$VENV"/.req-*; touch "$stamp"
fi

mkdir -p "$OUT"
rm -f "$OUT/junit.xml" "$OUT/passed.txt" "$OUT/failed.txt" "$OUT/skipped.txt" "$OUT/selected.txt"
# Keep the caller's AWS config files and profile out of the suite's boto3 clients.
export AWS_CONFIG_FILE=/dev/null AWS_SHARED_CREDENTIALS_FILE=/dev/null AWS_DEFAULT_REGION=${AWS_DEFAULT_REGION:-us-east-1}
unset AWS_PROFILE AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN AWS_ENDPOINT_URL

# host, port, is_secure from the URL; the owner (id, display name) from ListBuckets unless given.
IFS=$'\t' read -r HOST PORT SECURE OWNER_ID OWNER_NAME < <("$PY" - "$ENDPOINT" <<'PY'
import sys, urllib.parse, boto3
u = urllib.parse.urlsplit(sys.argv[1])
secure = u.scheme == "https"
port = u.port or (443 if secure else 80)
oid = oname = "-"
try:
    import os
    c = boto3.client("s3", endpoint_url=sys.argv[1], aws_access_key_id=os.environ["S3T_ACCESS_KEY"],
                     aws_secret_access_key=os.environ["S3T_SECRET_KEY"], verify=False)
    o = c.list_buckets().get("Owner", {})
    oid, oname = o.get("ID") or "-", o.get("DisplayName") or "-"
except Exception as e:
    print("s3-tests.sh: ListBuckets failed: %s" % e, file=sys.stderr)
print(u.hostname, port, secure, oid, oname, sep="\t")
PY
)
[ "$OWNER_ID" = - ] && OWNER_ID=testid
[ "$OWNER_NAME" = - ] && OWNER_NAME=$OWNER_ID
MAIN_ID=${S3T_USER_ID:-$OWNER_ID}
MAIN_NAME=${S3T_DISPLAY_NAME:-$OWNER_NAME}
MAIN_EMAIL=${S3T_EMAIL:-tester@example.com}
if [ -n "${S3T_ALT_ACCESS_KEY:-}" ] && [ -n "${S3T_ALT_SECRET_KEY:-}" ]; then
  HAVE_ALT=1; ALT_AK=$S3T_ALT_ACCESS_KEY; ALT_SK=$S3T_ALT_SECRET_KEY
  # The second user's owner id and name as the store reports them (its ListBuckets), unless given.
  IFS=$'\t' read -r ALT_OWNER_ID ALT_OWNER_NAME < <(S3T_ACCESS_KEY=$ALT_AK S3T_SECRET_KEY=$ALT_SK "$PY" - "$ENDPOINT" <<'PY'
import os, sys, boto3
try:
    c = boto3.client("s3", endpoint_url=sys.argv[1], aws_access_key_id=os.environ["S3T_ACCESS_KEY"],
                     aws_secret_access_key=os.environ["S3T_SECRET_KEY"], verify=False)
    o = c.list_buckets().get("Owner", {})
    print(o.get("ID") or "altid", o.get("DisplayName") or o.get("ID") or "altid", sep="\t")
except Exception as e:
    print("s3-tests.sh: ListBuckets as the second user failed: %s" % e, file=sys.stderr)
    print("altid", "altid", sep="\t")
PY
)
  ALT_ID=${S3T_ALT_USER_ID:-$ALT_OWNER_ID}; ALT_NAME=${S3T_ALT_DISPLAY_NAME:-$ALT_OWNER_NAME}
  ALT_EMAIL=${S3T_ALT_EMAIL:-alt@example.com}
else
  # The suite's per-test setup/teardown lists and empties prefixed buckets as alt and tenant too, so
  # those sections must hold working keys: the main ones (the tests that need a real second user are
  # deselected below).
  HAVE_ALT=0; ALT_AK=$S3T_ACCESS_KEY; ALT_SK=$S3T_SECRET_KEY
  ALT_ID=$MAIN_ID; ALT_NAME=$MAIN_NAME; ALT_EMAIL=$MAIN_EMAIL
fi

# A tenant user: its display name as the store reports it (its ListBuckets).
TENANT=${S3T_TENANT:-s3t}
if [ -n "${S3T_TENANT_ACCESS_KEY:-}" ] && [ -n "${S3T_TENANT_SECRET_KEY:-}" ]; then
  HAVE_TENANT=1; TENANT_AK=$S3T_TENANT_ACCESS_KEY; TENANT_SK=$S3T_TENANT_SECRET_KEY
  TENANT_NAME=$(S3T_ACCESS_KEY=$TENANT_AK S3T_SECRET_KEY=$TENANT_SK "$PY" - "$ENDPOINT" <<'PY'
import os, sys, boto3
c = boto3.client("s3", endpoint_url=sys.argv[1], aws_access_key_id=os.environ["S3T_ACCESS_KEY"],
                 aws_secret_access_key=os.environ["S3T_SECRET_KEY"], verify=False)
print(c.list_buckets().get("Owner", {}).get("DisplayName") or "tenanted")
PY
)
  TENANT_ID=${S3T_TENANT_USER_ID:-$TENANT\$$TENANT_NAME}; TENANT_EMAIL=$TENANT_NAME@example.com
else
  HAVE_TENANT=0; TENANT_AK=$ALT_AK; TENANT_SK=$ALT_SK
  TENANT_NAME=$ALT_NAME; TENANT_ID=$ALT_ID; TENANT_EMAIL=$ALT_EMAIL
fi
export S3T_HAVE_TENANT=$HAVE_TENANT

CONF=$OUT/s3tests.conf
cat > "$CONF" <<CONF
[DEFAULT]
host = $HOST
port = $PORT
is_secure = $SECURE
ssl_verify = False

[fixtures]
bucket prefix = s3t-{random}-
iam name prefix = s3t-
iam path prefix = /s3t/

[s3 main]
display_name = $MAIN_NAME
user_id = $MAIN_ID
email = $MAIN_EMAIL
api_name = default
access_key = $S3T_ACCESS_KEY
secret_key = $S3T_SECRET_KEY

[s3 alt]
display_name = $ALT_NAME
user_id = $ALT_ID
email = $ALT_EMAIL
access_key = $ALT_AK
secret_key = $ALT_SK

# Without a tenant user the tests that need one are deselected, and these keys serve the cleanup.
[s3 tenant]
display_name = $TENANT_NAME
user_id = $TENANT_ID
email = $TENANT_EMAIL
access_key = $TENANT_AK
secret_key = $TENANT_SK
tenant = $TENANT

# No IAM either (the parser requires these sections; the IAM tests are deselected).
[iam]
display_name = $ALT_NAME
user_id = $ALT_ID
email = $ALT_EMAIL
access_key = $ALT_AK
secret_key = $ALT_SK

[iam root]
access_key = $ALT_AK
secret_key = $ALT_SK
user_id = $ALT_ID
email = $ALT_EMAIL

[iam alt root]
access_key = $ALT_AK
secret_key = $ALT_SK
user_id = $ALT_ID
email = $ALT_EMAIL
CONF

# A pytest plugin that deselects the tests needing a second user (without S3T_HAVE_ALT=1), a tenant
# user (without S3T_HAVE_TENANT=1) or IAM: test functions that reach, directly or through the module's helpers, the suite's
# accessors for those users.
PLUG=$OUT/.plugin
mkdir -p "$PLUG"
cat > "$PLUG/s3t_select.py" <<'PY'
import ast, os
ALT = {"get_alt_client", "get_alt_aws_access_key", "get_alt_aws_secret_key", "get_alt_display_name",
       "get_alt_user_id", "get_alt_email", "get_alt_iam_client"}
TENANT = {"get_tenant_client", "get_v2_tenant_client", "get_tenant_aws_access_key",
          "get_tenant_aws_secret_key", "get_tenant_display_name", "get_tenant_name", "get_tenant_user_id",
          "get_tenant_email"}
IAM = {"iam_root", "iam_alt_root", "get_iam_client", "get_iam_s3client", "get_iam_root_client", "get_tenant_iam_client",
       "get_iam_alt_root_client", "get_iam_root_s3client", "get_iam_access_key", "get_iam_secret_key",
       "get_sts_client"}

def _needing(path, seeds):
    tree = ast.parse(open(path).read())
    refs = {}
    for fn in tree.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = {a.arg for a in fn.args.args}  # fixtures
            for n in ast.walk(fn):
                if isinstance(n, ast.Name): names.add(n.id)
                elif isinstance(n, ast.Attribute): names.add(n.attr)
            refs[fn.name] = names
    bad, grew = set(), True
    while grew:
        grew = False
        for name, names in refs.items():
            if name not in bad and names & (seeds | bad):
                bad.add(name); grew = True
    return bad

def pytest_collection_modifyitems(session, config, items):
    seeds = IAM | (set() if os.environ.get("S3T_HAVE_ALT") == "1" else ALT)
    seeds |= set() if os.environ.get("S3T_HAVE_TENANT") == "1" else TENANT
    cache, keep, drop = {}, [], []
    for it in items:
        path = str(it.fspath)
        if path not in cache:
            cache[path] = _needing(path, seeds)
        name = getattr(it, "originalname", None) or it.name.split("[")[0]
        (drop if name in cache[path] else keep).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
PY

PLUGINS=(-p s3t_select)
if [ "${S3T_DELETE_OBJECTS_MD5:-0}" = 1 ]; then
  PLUGINS+=(-p s3t_md5)
  cat > "$PLUG/s3t_md5.py" <<'PY'
import base64, hashlib
import botocore.handlers

def _content_md5(request, **_):
    body = request.body if isinstance(request.body, bytes) else (request.body or "").encode()
    request.headers["Content-MD5"] = base64.b64encode(hashlib.md5(body).digest()).decode()

# Every botocore session made after this (the suite makes its clients at test time) gets the handler.
botocore.handlers.BUILTIN_HANDLERS.append(("before-sign.s3.DeleteObjects", _content_md5))
PY
fi

# With a second user, the bucket-policy tests are selected too (most grant or refuse that user).
POLICY=" or bucket_policy"; [ "$HAVE_ALT" = 1 ] && POLICY=
MARKEXPR=${S3T_MARKEXPR:-"not (encryption or sse_s3 or bucket_encryption or lifecycle or lifecycle_expiration or lifecycle_transition or cloud_transition or cloud_restore$POLICY or bucket_logging or bucket_logging_cleanup or fails_without_logging_rollover or iam_account or iam_user or iam_tenant or iam_cross_account)"}
KEYWORDS=${S3T_KEYWORDS:-"not (object_lock or policy_status)"}
TIMEOUT=()
"$PY" -c 'import pytest_timeout' 2>/dev/null && TIMEOUT=(--timeout "${S3T_TIMEOUT:-300}")
# shellcheck disable=SC2086
ARGS=(-p no:cacheprovider "${PLUGINS[@]}" -m "$MARKEXPR" -k "$KEYWORDS" $TESTS ${S3T_EXTRA_ARGS:-})
export S3TEST_CONF=$CONF S3T_HAVE_ALT=$HAVE_ALT PYTHONPATH=$PLUG${PYTHONPATH:+:$PYTHONPATH}

cd "$SUITE"
commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
"$PY" -m pytest "${ARGS[@]}" --collect-only -q > "$OUT/collect.log" 2>&1 || {
  echo "s3-tests.sh: collection failed; see $OUT/collect.log" >&2; tail -20 "$OUT/collect.log" >&2; exit 1; }
grep '::' "$OUT/collect.log" | LC_ALL=C sort > "$OUT/selected.txt" || true
echo "s3-tests.sh: suite $commit ($PKG), endpoint $ENDPOINT, alt user: $([ $HAVE_ALT = 1 ] && echo yes || echo no)," \
  "owner $MAIN_ID; $(tail -1 "$OUT/collect.log")"
start=$(date +%s)
rc=0
"$PY" -m pytest "${ARGS[@]}" "${TIMEOUT[@]}" -q --tb=short -rfE -o junit_family=xunit2 \
  --junitxml "$OUT/junit.xml" > "$OUT/pytest.log" 2>&1 || rc=$?
wall=$(( $(date +%s) - start ))
[ -f "$OUT/junit.xml" ] || { echo "s3-tests.sh: pytest exited $rc without junit.xml; see $OUT/pytest.log" >&2; tail -20 "$OUT/pytest.log" >&2; exit 1; }

# junit.xml -> sorted node-id lists (a test failing in its call or its setup/teardown counts as failed).
"$PY" - "$OUT" "$SUITE" <<'PY'
import os, sys, xml.etree.ElementTree as ET
out, suite = sys.argv[1], sys.argv[2]
rank = {"passed": 0, "skipped": 1, "failed": 2}
status = {}
for tc in ET.parse(os.path.join(out, "junit.xml")).getroot().iter("testcase"):
    parts = tc.get("classname", "").split(".")
    # classname is the module's dotted path, then any classes: find where the file ends.
    i = next((i for i in range(len(parts), 0, -1)
              if os.path.isfile(os.path.join(suite, *parts[:i]) + ".py")), len(parts))
    nid = "::".join(["/".join(parts[:i]) + ".py"] + parts[i:] + [tc.get("name")])
    kids = {c.tag for c in tc}
    s = "failed" if kids & {"failure", "error"} else "skipped" if "skipped" in kids else "passed"
    if rank[s] >= rank[status.get(nid, "passed")]:
        status[nid] = s
for s in rank:
    with open(os.path.join(out, s + ".txt"), "w") as f:
        f.writelines(n + "\n" for n in sorted(k for k, v in status.items() if v == s))
PY
n() { wc -l < "$OUT/$1.txt" | tr -d ' '; }
echo "s3-tests.sh: $(n passed) passed, $(n failed) failed, $(n skipped) skipped of $(n selected) selected in ${wall}s" \
  "(pytest: $(tail -1 "$OUT/pytest.log" | tr -d '='))"
echo "s3-tests.sh: results in $OUT (passed.txt, failed.txt, junit.xml, pytest.log)"
case $rc in 0|1) exit 0 ;; *) exit "$rc" ;; esac
