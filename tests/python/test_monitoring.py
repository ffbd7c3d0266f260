"""The dashboard (deploy/grafana/tensorgate.json) and the alert rules (deploy/prometheus/) against a
real Prometheus (Debian's 2.42, scripts/prometheus.sh, installed when missing like the stores):
promtool checks the rules and runs their unit tests, where every alert fires in one case and stays
quiet in another; then Prometheus scrapes a two-member cluster of gateways in front of SeaweedFS
under a short bounded load, and every query of the dashboard returns series (a metric renamed in
the code fails here) while the rules evaluate on what it scraped."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import botocore.exceptions
import numpy as np
import pytest
import yaml

from conftest import ROOT, free_port, metric, run_gateway
from test_pushdown import npy_bytes, pushdown_get

from tensorgate.cluster import rank

DASHBOARD = ROOT / "deploy" / "grafana" / "tensorgate.json"
RULES = ROOT / "deploy" / "prometheus" / "tensorgate-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tensorgate-rules.test.yml"
PROM_PORT = 19090
# What the dashboard's Grafana variables become in a query: `$__rate_interval` a window holding
# many 1 s scrapes, every instance (the "All" of the instance variable).
RATE_WINDOW = "1m"
SPEC = dict(model="tiny-cnn", split="pool")


@pytest.fixture(scope="module")
def promtool() -> str:
    """promtool, from Debian's prometheus package (installed as root when missing: a missing tool
    fails the tests, it does not skip them)."""
    subprocess.run([str(ROOT / "scripts" / "prometheus.sh"), "install"], check=True)
    path = shutil.which("promtool")
    assert path, "promtool missing after scripts/prometheus.sh install"
    return path


def alert_rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]


def test_the_rules_pass_promtool_check(promtool):
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in r.stdout, r.stdout


def test_every_alert_fires_and_stays_quiet_in_the_rule_unit_tests(promtool):
    alerts = alert_rules()
    assert {g["name"] for g in yaml.safe_load(RULES.read_text())["groups"]} == {"tensorgate"}
    for rule in alerts:
        assert rule.get("for") and rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert {"summary", "description"} <= rule["annotations"].keys(), rule["alert"]
    cases = yaml.safe_load(RULE_TESTS.read_text())
    assert cases["rule_files"] == [RULES.name]
    fires, quiet = set(), set()
    for case in cases["tests"]:
        for check in case.get("alert_rule_test", []):
            expected = check.get("exp_alerts") or []
            # A firing case names the labels and the annotations the alert must carry.
            assert all({"exp_labels", "exp_annotations"} <= e.keys() for e in expected), (case["name"], check)
            (fires if expected else quiet).add(check["alertname"])
    names = {r["alert"] for r in alerts}
    assert len(names) == len(alerts)
    assert names - fires == set(), f"alerts without a case where they fire: {sorted(names - fires)}"
    assert names - quiet == set(), f"alerts without a case where they stay quiet: {sorted(names - quiet)}"
    assert fires | quiet <= names, f"cases for alerts the rules do not have: {sorted((fires | quiet) - names)}"
    r = subprocess.run([promtool, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# A real Prometheus scraping a loaded cluster.


def wait_for(what: str, cond, timeout: float = 60.0, period: float = 0.2):
    """Polls `cond` until it returns something truthy (returned), at most `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(period)


def prom_api(base: str, path: str, **params) -> dict:
    url = f"{base}/api/v1/{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
    except urllib.error.HTTPError as e:  # a query Prometheus refused: say which and why
        raise AssertionError(f"{params}: {e.code} {e.read().decode()}") from None
    assert body["status"] == "success", body
    return body["data"]


def query(base: str, expr: str) -> list[dict]:
    data = prom_api(base, "query", query=expr)
    assert data["resultType"] == "vector", (expr, data)
    return data["result"]


def cluster_config(node: str, members: list[dict], extra: str = "") -> str:
    rows = ", ".join(f'{{ id = "{m["id"]}", s3 = "{m["s3"]}", admin = "{m["admin"]}" }}' for m in members)
    # A hop secret: members forward pushdowns to their owners. Membership is probed once, at start
    # (refresh_secs: an hour): a member killed later stays "ready" to the other, whose next hop to
    # it fails and is computed locally (a fallback), as between two probes in production.
    return (f"{extra}[cluster]\nnode_id = \"{node}\"\nmembers = [{rows}]\nrefresh_secs = 3600\n"
            f"probe_timeout_ms = 1000\nsecret_key = \"monitoring-hop-secret\"\n")


def member_states(admin: str) -> list[str]:
    with urllib.request.urlopen(f"{admin}/v1/cluster", timeout=5) as r:
        return [m["state"] for m in json.load(r)["members"]]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=1):
            return True
    except OSError:
        return False


def panel_targets(dashboard: dict):
    """(panel title, refId, expr) of every query in the dashboard, rows' panels included."""
    for panel in dashboard["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            for t in p.get("targets", []):
                yield p["title"], t["refId"], t["expr"]


def label_values(base: str, definition: str, variables: dict) -> list[str]:
    """A Grafana `label_values(selector, label)` variable query, as Grafana asks Prometheus."""
    m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", definition)
    assert m, definition
    selector = substitute(m.group(1), variables)
    series = prom_api(base, "series", **{"match[]": selector})
    return sorted({s[m.group(2)] for s in series if m.group(2) in s})


def substitute(expr: str, variables: dict) -> str:
    out = expr.replace("$__rate_interval", RATE_WINDOW)
    for name, value in variables.items():
        out = out.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in out, f"a variable the test does not know: {expr}"
    return out


def load(s3, admin_a, bucket, keys, kill_b):
    """The bounded load: plain S3 operations, a 404, a listing, pushdowns computed here and at the
    owner (each twice, so the second is a cache hit), an engine started again after its idle
    eviction, one request shed (503 SlowDown) and one hop to a killed owner (a fallback)."""
    a_keys, b_keys = keys
    s3.create_bucket(Bucket=bucket)
    s3.put_object(Bucket=bucket, Key="plain.txt", Body=b"plain bytes")
    for i, key in enumerate(a_keys + b_keys):
        s3.put_object(Bucket=bucket, Key=key, Body=npy_bytes(np.random.default_rng(i).random((3, 32, 32), dtype=np.float32)))
    assert s3.get_object(Bucket=bucket, Key="plain.txt")["Body"].read() == b"plain bytes"
    assert s3.head_object(Bucket=bucket, Key="plain.txt")["ContentLength"] == 11
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket=bucket, Key="missing.txt")
    assert e.value.response["Error"]["Code"] == "NoSuchKey"
    assert len(s3.list_objects_v2(Bucket=bucket)["Contents"]) == 1 + len(a_keys) + len(b_keys)

    def pushdown(key):
        r = pushdown_get(s3, bucket, key, **SPEC)
        r["Body"].read()  # the response ends (and leaves max_in_flight) with its last byte
        h = r["ResponseMetadata"]["HTTPHeaders"]
        return h["x-tensorgate-cache"], h["x-tensorgate-computed-by"]

    # Twice each: computed, then from the cache (revalidated with the store), here and at the owner.
    assert [pushdown(a_keys[0]) for _ in range(2)] == [("miss", "node-0"), ("revalidated", "node-0")]
    assert [pushdown(b_keys[0]) for _ in range(2)] == [("miss", "node-1"), ("revalidated", "node-1")]
    # The engine is evicted when idle (pushdown.engine_idle_secs = 1) and started again.
    wait_for("an idle engine evicted",
             lambda: metric(admin_a, 'tensorgate_pushdown_engine_evictions_total{reason="idle"}') >= 1, timeout=30)
    assert pushdown(a_keys[1]) == ("miss", "node-0")
    assert metric(admin_a, 'tensorgate_pushdown_engine_starts_total{reason="remembered"}') >= 1
    # Shedding (max_in_flight = 1): an upload whose body stalls holds the one place.
    url = urllib.parse.urlsplit(s3.generate_presigned_url("put_object", Params={"Bucket": bucket, "Key": "stalled"},
                                                          ExpiresIn=300))
    with socket.create_connection((url.hostname, url.port), timeout=10) as stalled:
        stalled.sendall(f"PUT {url.path}?{url.query} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Length: 1000\r\n\r\n"
                        .encode() + b"x" * 10)
        wait_for("the stalled upload in flight", lambda: metric(admin_a, "tensorgate_in_flight_requests") == 1)
        with pytest.raises(botocore.exceptions.ClientError) as e:
            s3.get_object(Bucket=bucket, Key="plain.txt")
        assert e.value.response["Error"]["Code"] == "SlowDown"
    wait_for("the stalled upload gone", lambda: metric(admin_a, "tensorgate_in_flight_requests") == 0, timeout=30)
    # boto3 retries a 503 SlowDown once (max_attempts 1): both attempts were shed.
    assert metric(admin_a, "tensorgate_load_shed_total") == 1 + e.value.response["ResponseMetadata"]["RetryAttempts"]
    # The owner of b_keys dies; this member still thinks it ready: its hop fails and it computes.
    kill_b()
    assert pushdown(b_keys[1]) == ("miss", "node-0")
    assert metric(admin_a, 'tensorgate_cluster_fallbacks_total{peer="node-1"}') == 1
    assert metric(admin_a, 'tensorgate_cluster_forwarded_total{peer="node-1"}') == 2


def test_every_dashboard_query_returns_series_from_a_real_prometheus(promtool, seaweed, tmp_path):
    members = [{"id": f"node-{i}", "s3": f"http://127.0.0.1:{free_port()}", "admin": f"http://127.0.0.1:{free_port()}"}
               for i in range(2)]
    a, b = members
    ids = [m["id"] for m in members]
    bucket = f"monitoring-{int(time.time() * 1000) % 10**9}"
    keys = ([], [])
    for i in range(1000):
        key = f"s/{i}.npy"
        owned = keys[ids.index(rank(ids, bucket, key)[0])]
        if len(owned) < 2:
            owned.append(key)
        if all(len(k) == 2 for k in keys):
            break
    assert all(len(k) == 2 for k in keys), keys
    env = dict(os.environ, PROM_PORT=str(PROM_PORT), PROM_SCRAPE_PORTS=f"{port_of(a['admin'])},{port_of(b['admin'])}",
               PROM_RULES=str(RULES))
    prometheus = f"http://127.0.0.1:{PROM_PORT}"
    with contextlib.ExitStack() as stack:
        # node-1 first, so that node-0's one membership probe finds it ready.
        _, _, _, b_pid = stack.enter_context(run_gateway(
            tmp_path, cluster_config(b["id"], members), seaweed=seaweed, ports=(port_of(b["s3"]), port_of(b["admin"]))))
        _, admin_a, s3, _ = stack.enter_context(run_gateway(
            tmp_path, cluster_config(a["id"], members, "max_in_flight = 1\n[pushdown]\nengine_idle_secs = 1\n"),
            seaweed=seaweed, ports=(port_of(a["s3"]), port_of(a["admin"]))))
        wait_for("node-1 ready to node-0", lambda: member_states(admin_a) == ["ready", "ready"])
        stack.callback(subprocess.run, [str(ROOT / "scripts" / "prometheus.sh"), "stop"], env=env, check=False)
        out = subprocess.run([str(ROOT / "scripts" / "prometheus.sh"), "start"], env=env, check=True,
                             capture_output=True, text=True)
        assert out.stdout.strip() == prometheus
        # Prometheus takes up new targets a few seconds after it starts: the load begins once it
        # scraped both members, so that its counters grow from one scrape to the next.
        a_target, b_target = (m["admin"].removeprefix("http://") for m in members)
        wait_for("Prometheus to scrape both members", lambda: sorted(
            r["metric"]["instance"] for r in query(prometheus, 'up{job="tensorgate"} == 1')) == sorted([a_target, b_target]))

        def kill_b():
            os.kill(b_pid, signal.SIGKILL)
            wait_for("node-1 gone", lambda: not answers(b["admin"]), timeout=30)

        load(s3, admin_a, bucket, keys, kill_b)

        # Prometheus has scraped node-0 after the load (the requests it counted are all of them),
        # and once more, so that every series, the last ones made too, has two samples to rate.
        total = metric(admin_a, "tensorgate_requests_total")

        def counted():
            now = query(prometheus, f'sum(tensorgate_requests_total{{instance="{a_target}"}})')
            return now and float(now[0]["value"][1]) == total

        def last_scrape():
            return float(query(prometheus, f'timestamp(up{{instance="{a_target}"}})')[0]["value"][1])

        wait_for("Prometheus to scrape node-0 after the load", counted)
        after = last_scrape()
        wait_for("one more scrape of node-0", lambda: last_scrape() > after)

        dashboard = json.loads(DASHBOARD.read_text())
        variables = {}
        for var in dashboard["templating"]["list"]:
            if var["type"] == "datasource":
                assert var["query"] == "prometheus"
                continue
            values = label_values(prometheus, var["definition"], variables)
            assert values, f"variable {var['name']}: {var['definition']} has no values"
            if var["name"] == "job":
                assert values == ["tensorgate"], values
            if var.get("includeAll"):
                assert a_target in values, values
                variables[var["name"]] = var["allValue"]
            else:
                variables[var["name"]] = values[0]
        failures = []
        targets = list(panel_targets(dashboard))
        for title, ref, expr in targets:
            result = query(prometheus, substitute(expr, variables))
            if not result:
                failures.append(f"panel {title!r} query {ref}: {expr}")
        assert not failures, "dashboard queries without series:\n" + "\n".join(failures)
        assert len(targets) >= 40

        # The rules, loaded by that Prometheus, evaluate without error on the real series, and
        # the one whose condition holds (node-1 down) is on its way to firing.
        def evaluated():
            rules = [r for g in prom_api(prometheus, "rules")["groups"] for r in g["rules"]]
            assert all(r["health"] != "err" for r in rules), [(r["name"], r.get("lastError")) for r in rules]
            return len(rules) == len(alert_rules()) and all(r["health"] == "ok" for r in rules) and rules

        rules = wait_for("every rule evaluated", evaluated)
        assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
        down = wait_for("TensorgateDown pending for node-1", lambda: [
            x for x in prom_api(prometheus, "alerts")["alerts"]
            if x["labels"]["alertname"] == "TensorgateDown" and x["labels"].get("instance") == b_target])
        assert down[0]["state"] in ("pending", "firing") and down[0]["labels"]["severity"] == "critical", down
