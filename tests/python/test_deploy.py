"""The Helm chart (deploy/helm/tensorgate) rendered offline by Helm's own engine (helm-python-sdk)
and checked against the Kubernetes API schemas (kubernetes-validate), its configuration accepted by
the gateway binary, and the values that change what it renders."""

import json
import subprocess

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from conftest import BINARY, ROOT

CHART = ROOT / "deploy" / "helm" / "tensorgate"
K8S = "1.32.0"  # a Kubernetes version well inside the supported window
CREDS = {"accessKey": "ak", "secretKey": "sk", "backendAccessKey": "bak", "backendSecretKey": "bsk",
         "clusterSecret": "cs"}
TERMINATING = {"identity": "terminating", "credentials": CREDS}
DASHBOARD = ROOT / "deploy" / "grafana" / "tensorgate.json"
RULES = ROOT / "deploy" / "prometheus" / "tensorgate-rules.yml"


def render(values: dict) -> dict[str, list[dict]]:
    """Rendered manifests by kind (`Kind` -> documents)."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name="tg", namespace="storage")
    docs: dict[str, list[dict]] = {}
    for text in out.values():
        for doc in yaml.safe_load_all(text):
            if doc:
                docs.setdefault(doc["kind"], []).append(doc)
    return docs


def test_the_chart_lints_and_every_manifest_matches_the_kubernetes_schemas():
    findings = helm.lint(str(CHART))
    # Helm's severities: 1 info (e.g. "icon is recommended"), 2 warning, 3 error.
    assert findings["errors"] == [] and all(m["severity"] < 2 for m in findings["messages"]), findings
    for values, kinds in (({}, ["ConfigMap", "DaemonSet", "NetworkPolicy", "Service"]),
                          (TERMINATING, ["ConfigMap", "DaemonSet", "NetworkPolicy", "Secret", "Service"])):
        docs = render(values)
        assert sorted(docs) == kinds
        for items in docs.values():
            for doc in items:
                kubernetes_validate.validate(doc, K8S, strict=True)


def test_the_rendered_configuration_is_one_the_gateway_accepts(tmp_path):
    docs = render({**TERMINATING, "config": {"max_in_flight": 77, "pushdown": {"memory_budget": 2 << 30}}})
    toml = docs["ConfigMap"][0]["data"]["config.toml"]
    assert "max_in_flight = 77" in toml and "memory_budget = 2147483648" in toml  # integers, not floats
    assert 'dns = "tg-tensorgate-headless.storage.svc.cluster.local:9000"' in toml
    # What the pod sees: the ConfigMap's file, the cluster secret mounted where the file names it
    # (here a file of the test's), and the DaemonSet's environment with the Secret's values and
    # the downward-API addresses filled in.
    (tmp_path / "cluster-secret").write_text(CREDS["clusterSecret"])
    (tmp_path / "config.toml").write_text(
        toml.replace("/run/secrets/tensorgate/cluster-secret", str(tmp_path / "cluster-secret")))
    secret = docs["Secret"][0]["stringData"]
    env = {"PATH": "/usr/bin:/bin"}
    addresses = {"HOST_IP": "10.0.0.7", "POD_IP": "10.1.0.9"}
    for e in docs["DaemonSet"][0]["spec"]["template"]["spec"]["containers"][0]["env"]:
        if "value" in e:
            v = e["value"]
            for k, ip in addresses.items():
                v = v.replace(f"$({k})", ip)
            env[e["name"]] = v
        elif "secretKeyRef" in e["valueFrom"]:
            env[e["name"]] = secret[e["valueFrom"]["secretKeyRef"]["key"]]
    env.pop("TENSORGATE_CONFIG")
    assert env["TENSORGATE_CLUSTER_NODE_ID"] == "10.1.0.9:9000"
    r = subprocess.run([str(BINARY), "check-config", str(tmp_path / "config.toml")], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    # The same file without the environment is refused: the chart relies on it.
    r = subprocess.run([str(BINARY), "check-config", str(tmp_path / "config.toml")], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode != 0


def test_alias_endpoints_are_ports_of_the_pod_the_service_and_the_policy(tmp_path):
    """`aliasEndpoints` renders each as `[[pushdown.alias_endpoints]]` on all addresses, a named
    container port, a Service port and an S3-side NetworkPolicy port; the gateway accepts the
    file, and the manifests match the Kubernetes schemas."""
    endpoints = [{"name": "feat-pool", "port": 9100, "model": "tiny-cnn", "split": "pool"},
                 {"name": "feat-parquet", "port": 9101, "model": "tiny-cnn", "split": "pool", "format": "parquet"}]
    docs = render({"aliasEndpoints": endpoints, "cluster": {"enabled": False}})
    for items in docs.values():
        for doc in items:
            kubernetes_validate.validate(doc, K8S, strict=True)
    toml = docs["ConfigMap"][0]["data"]["config.toml"]
    (tmp_path / "config.toml").write_text(toml)
    import tomllib

    cfg = tomllib.loads(toml)
    assert cfg["pushdown"]["alias_endpoints"] == [
        {"listen": "0.0.0.0:9100", "model": "tiny-cnn", "split": "pool"},
        {"listen": "0.0.0.0:9101", "model": "tiny-cnn", "split": "pool", "format": "parquet"}]
    r = subprocess.run([str(BINARY), "check-config", str(tmp_path / "config.toml")], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "TENSORGATE_BACKEND_ENDPOINT": "http://10.0.0.7:8333"})
    assert r.returncode == 0, r.stdout + r.stderr
    ports = {p["name"]: p["containerPort"] for p in docs["DaemonSet"][0]["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"s3": 9000, "admin": 9001, "feat-pool": 9100, "feat-parquet": 9101}
    assert {p["name"]: p["port"] for p in docs["Service"][0]["spec"]["ports"]} == ports
    s3_side = docs["NetworkPolicy"][0]["spec"]["ingress"][0]["ports"]
    assert [p["port"] for p in s3_side] == ["s3", "feat-pool", "feat-parquet"]


def test_the_daemonset_runs_beside_the_store_non_root_with_probes_and_derived_memory():
    docs = render({**TERMINATING, "nodeSelector": {"storage": "true"},
                   "config": {"pushdown": {"memory_budget": 3 << 30, "cache": {"memory_bytes": 1 << 30}}},
                   "memoryOverheadBytes": 1 << 29})
    pod = docs["DaemonSet"][0]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert pod["nodeSelector"] == {"storage": "true"} and pod["securityContext"]["runAsNonRoot"] is True
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    want = str((3 << 30) + (1 << 30) + (1 << 29))
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"] == want
    env = {e["name"]: e for e in c["env"]}
    assert env["TENSORGATE_CLUSTER_NODE_ID"]["value"] == "$(POD_IP):9000"
    assert env["TENSORGATE_BACKEND_ENDPOINT"]["value"] == "http://$(HOST_IP):8333"
    assert env["TENSORGATE_SECRET_KEY"]["valueFrom"]["secretKeyRef"]["key"] == "secret-key"
    svc = docs["Service"][0]["spec"]
    assert svc["clusterIP"] == "None" and {p["name"] for p in svc["ports"]} == {"s3", "admin"}


def test_transparent_identity_by_default_holds_no_secret_and_the_gateway_accepts_it(tmp_path):
    """The chart's default: the store authenticates every client with its own users (ADR 0013),
    so no key is asked for, no Secret is rendered or mounted, no key reaches the environment, and
    members share no hop secret; the binary accepts what the pod gets."""
    docs = render({})
    assert "Secret" not in docs
    pod = docs["DaemonSet"][0]["spec"]["template"]["spec"]
    env = pod["containers"][0]["env"]
    assert not [e for e in env if "secretKeyRef" in e.get("valueFrom", {})], env
    assert {v["name"] for v in pod["volumes"]} == {"config", "tmp"}
    toml = docs["ConfigMap"][0]["data"]["config.toml"]
    assert 'identity = "transparent"' in toml and "secret_key_file" not in toml
    (tmp_path / "config.toml").write_text(toml)
    pod_env = {"PATH": "/usr/bin:/bin", "TENSORGATE_BACKEND_ENDPOINT": "http://10.0.0.7:8333",
               "TENSORGATE_CLUSTER_NODE_ID": "10.1.0.9:9000"}
    r = subprocess.run([str(BINARY), "check-config", str(tmp_path / "config.toml")], capture_output=True, text=True,
                       env=pod_env)
    assert r.returncode == 0, r.stdout + r.stderr
    # The mode is transparent as the binary reads it: it refuses a client key beside it.
    r = subprocess.run([str(BINARY), "check-config", str(tmp_path / "config.toml")], capture_output=True, text=True,
                       env=dict(pod_env, TENSORGATE_ACCESS_KEY="ak", TENSORGATE_SECRET_KEY="sk"))
    assert r.returncode != 0 and "holds no client secrets" in r.stderr, r.stdout + r.stderr
    with pytest.raises(Exception) as e:
        render({"identity": "both"})
    assert "identity must be" in str(e.value)


def test_the_admin_port_is_open_to_members_and_named_peers_only():
    """The NetworkPolicy: S3 from everyone (or `s3From`), the admin port (metrics, the pushdown
    control API) from the other members and `adminFrom` only; `enabled: false` renders none."""
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    policy = render({"networkPolicy": {"adminFrom": [monitoring]}})["NetworkPolicy"][0]["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "tg"
    s3, admin = policy["ingress"]
    assert s3["ports"] == [{"port": "s3", "protocol": "TCP"}] and "from" not in s3
    assert admin["ports"] == [{"port": "admin", "protocol": "TCP"}]
    assert admin["from"] == [{"podSelector": {"matchLabels": policy["podSelector"]["matchLabels"]}}, monitoring]
    clients = {"ipBlock": {"cidr": "10.2.0.0/16"}}
    s3 = render({"networkPolicy": {"s3From": [clients]}})["NetworkPolicy"][0]["spec"]["ingress"][0]
    assert s3["from"] == [clients]
    assert "NetworkPolicy" not in render({"networkPolicy": {"enabled": False}})


def test_values_select_what_is_rendered():
    with pytest.raises(Exception) as e:
        render({"identity": "terminating"})
    assert "credentials.accessKey" in str(e.value)
    docs = render({"identity": "terminating", "credentials": {"existingSecret": "mine"},
                   "serviceMonitor": {"enabled": True}, "cluster": {"enabled": False}})
    assert "Secret" not in docs
    env = docs["DaemonSet"][0]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert all(e.get("valueFrom", {}).get("secretKeyRef", {}).get("name", "mine") == "mine" for e in env)
    assert "TENSORGATE_CLUSTER_NODE_ID" not in {e["name"] for e in env}
    assert "[cluster]" not in docs["ConfigMap"][0]["data"]["config.toml"]
    monitor = docs["ServiceMonitor"][0]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["endpoints"][0] == {"port": "admin", "path": "/metrics", "interval": "30s"}


def test_any_config_key_comes_from_the_environment(tmp_path):
    # A container sets any key without a file: TENSORGATE__<SECTION>__<KEY>, checked as the file's.
    import json
    import urllib.request

    from conftest import run_gateway

    env = {"TENSORGATE__PUSHDOWN__MEMORY_BUDGET": str(777 << 20), "TENSORGATE__PUSHDOWN__ORT_ARENA": "per-run"}
    with run_gateway(tmp_path, env=env) as (_, admin, _, _):
        report = json.load(urllib.request.urlopen(f"{admin}/v1/memory"))
        assert report["budget_bytes"] == 777 << 20
    r = subprocess.run([str(BINARY), "check-config", str(ROOT / "config" / "example.toml")], capture_output=True,
                       text=True, env={"PATH": "/usr/bin:/bin", "TENSORGATE__PUSHDOWN__MEMORY_BUDGT": "1"})
    assert r.returncode != 0 and "TENSORGATE__PUSHDOWN__MEMORY_BUDGT" in r.stderr, r.stderr


def test_monitoring_values_install_the_dashboard_and_the_alert_rules():
    """`monitoring.dashboard` renders a ConfigMap with deploy/grafana's dashboard, labelled for
    Grafana's dashboard sidecar; `monitoring.prometheusRule` a PrometheusRule with deploy/prometheus's
    rule groups (tests/python/test_monitoring.py checks both against a real Prometheus). The chart
    reads its copies in files/ (Helm reads nothing outside the chart): they must stay identical."""
    for source in (DASHBOARD, RULES):
        copy = CHART / "files" / source.name
        assert copy.read_bytes() == source.read_bytes(), f"{copy.relative_to(ROOT)} differs from {source.relative_to(ROOT)}: copy it"
    docs = render({"monitoring": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "Storage"}},
                                  "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}}},
                   "serviceMonitor": {"enabled": True}})
    assert sorted(docs) == ["ConfigMap", "DaemonSet", "NetworkPolicy", "PrometheusRule", "Service", "ServiceMonitor"]
    (dashboard,) = [d for d in docs["ConfigMap"] if d["metadata"]["name"] == "tg-tensorgate-dashboard"]
    kubernetes_validate.validate(dashboard, K8S, strict=True)
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "Storage"}
    assert dashboard["data"]["tensorgate.json"] + "\n" == DASHBOARD.read_text()
    assert json.loads(dashboard["data"]["tensorgate.json"])["uid"] == "tensorgate"
    (rule,) = docs["PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["spec"] == {"groups": yaml.safe_load(RULES.read_text())["groups"]}
    # The targets' job is "tensorgate", the job the rules and the dashboard name: the Services'
    # app.kubernetes.io/name, which the ServiceMonitor takes the job from.
    monitor = docs["ServiceMonitor"][0]["spec"]
    assert all(s["metadata"]["labels"][monitor["jobLabel"]] == "tensorgate" for s in docs["Service"])
    assert '{job="tensorgate"}' in RULES.read_text()
    # Another sidecar label and namespace; and by default, neither resource.
    docs = render({"monitoring": {"dashboard": {"enabled": True, "labelKey": "dashboards", "labelValue": "tensorgate",
                                                "namespace": "grafana"}}})
    (dashboard,) = [d for d in docs["ConfigMap"] if d["metadata"]["name"] == "tg-tensorgate-dashboard"]
    assert dashboard["metadata"]["labels"]["dashboards"] == "tensorgate" and "grafana_dashboard" not in dashboard["metadata"]["labels"]
    assert dashboard["metadata"]["namespace"] == "grafana" and "PrometheusRule" not in docs
    docs = render({})
    assert "PrometheusRule" not in docs and [d["metadata"]["name"] for d in docs["ConfigMap"]] == ["tg-tensorgate"]


def test_upgrades_hand_the_sockets_over_on_the_node():
    plain = render({})["DaemonSet"][0]
    assert plain["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 1}
    assert "hostNetwork" not in plain["spec"]["template"]["spec"]
    docs = render({"upgrade": {"enabled": True}})
    ds = docs["DaemonSet"][0]
    kubernetes_validate.validate(ds, K8S, strict=True)
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["TENSORGATE_UPGRADE_SOCKET"] == "/run/tensorgate/upgrade.sock"
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["upgrade"] == "/run/tensorgate"
    assert volumes["upgrade"]["hostPath"] == {"path": "/run/tensorgate", "type": "DirectoryOrCreate"}



def test_the_systemd_unit_verifies(tmp_path):
    """`deploy/systemd/tensorgate@.service` as systemd reads it (its binary: this build's)."""
    unit = (ROOT / "deploy" / "systemd" / "tensorgate@.service").read_text()
    assert "ExecStart=/usr/local/bin/tensorgate serve" in unit and "ExecReload=/bin/kill -HUP $MAINPID" in unit
    path = tmp_path / "tensorgate@blue.service"
    path.write_text(unit.replace("/usr/local/bin/tensorgate", str(BINARY)))
    out = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert (out.returncode, out.stdout + out.stderr) == (0, "")
