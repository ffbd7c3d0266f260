"""Scale-out under emulated links (docs/SCALING.md): a multi-process SeaweedFS cluster
(one master and one filer + S3 on the back-plane, one volume server per storage node) with one
tensorgate gateway per node, each node behind its own shaped link to the compute tier
(bench/cluster/topology.sh).

    sudo .venv/bin/python bench/cluster/run.py               # about 5 minutes
    sudo .venv/bin/python bench/cluster/run.py --nodes 1,2,3 --rate 25 --shards 24 --per-shard 16

For 1, 2 and 3 nodes: epoch-1 throughput of the routed client, raw shards (passthrough) and the
pushdown at the model's freeze split. With the most nodes, also: (a) epoch-2 cache hits with owner
routing against a client spreading its GETs over the members, without and with forwarding between
gateways; (b) a gateway killed mid-epoch: the epoch completes, only its share is recomputed, the
features are the same bytes as before; (c) every route gives the same bytes (the features of every
run are compared, across node counts too). The storage tier (every weed process and gateway) is
pinned to CPU 0, the client to CPU 1, as in bench/repro. Rows go to bench/results/cluster.jsonl,
the table to bench/results/cluster.md. The topology is always torn down.

`TENSORGATE_BIN` names the gateway binary (default: target/release/tensorgate).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "clients" / "python"))
import dataset  # noqa: E402

from tensorgate.cluster import rank  # noqa: E402

TOPOLOGY = ROOT / "bench" / "cluster" / "topology.sh"
CLIENT = ROOT / "bench" / "cluster" / "client.py"
FABRIC = "10.78.0.1"
S3_PORT, MASTER_PORT, FILER_PORT, VOLUME_PORT = 8333, 9333, 8888, 8080
AK, SK = "seaweed-ak", "seaweed-sk"
KEY, SECRET = "cluster", "cluster-secret"
BUCKET = "cluster"
WARM = "warmup/000.tar"  # a shard outside the dataset, asked of every member before an epoch


def node_ip(i: int) -> str:
    return f"10.78.0.{10 + i}"


#: CPUs of the storage tier (every weed process and gateway) and of the client (`--storage-cpus`).
CPUS = {"storage": "0", "client": "1"}


def ns_cmd(ns: str, tier: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, "taskset", "-c", CPUS[tier]] + argv


WAIT_S3 = """
import sys, time, boto3
s3 = boto3.client("s3", endpoint_url=sys.argv[1], aws_access_key_id=sys.argv[2], aws_secret_access_key=sys.argv[3],
                  region_name="us-east-1")
for _ in range(240):
    try:
        s3.list_buckets(); sys.exit(0)
    except Exception:
        time.sleep(0.5)
sys.exit("SeaweedFS S3 did not come up")
"""

UPLOAD = """
import io, sys, tarfile, boto3
s3 = boto3.client("s3", endpoint_url=sys.argv[1], aws_access_key_id=sys.argv[2], aws_secret_access_key=sys.argv[3],
                  region_name="us-east-1")
s3.create_bucket(Bucket=sys.argv[4])
with tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read())) as tar:
    for m in tar:
        s3.put_object(Bucket=sys.argv[4], Key=m.name, Body=tar.extractfile(m).read())
"""

WAIT_CLUSTER = """
import json, sys, time, urllib.request
want = int(sys.argv[2])
for _ in range(300):
    try:
        with urllib.request.urlopen(sys.argv[1] + "/v1/cluster", timeout=1) as r:
            if [m["state"] for m in json.load(r)["members"]].count("ready") == want:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.1)
sys.exit("cluster not ready")
"""


class Cluster:
    """The SeaweedFS cluster and the gateways of `n` nodes, in the namespaces of topology.sh."""

    def __init__(self, n: int, rate: int, workdir: Path):
        self.n, self.rate, self.dir = n, rate, workdir / f"n{n}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.gateways: dict[int, subprocess.Popen] = {}
        self.s3 = f"http://{FABRIC}:{S3_PORT}"
        self.members = [{"id": f"node-{i}", "s3": f"http://{node_ip(i)}:9000", "admin": f"http://{node_ip(i)}:9001"}
                        for i in range(1, n + 1)]

    def spawn(self, ns: str, argv: list[str], log: str, env: dict | None = None) -> subprocess.Popen:
        out = open(self.dir / log, "w")
        p = subprocess.Popen(ns_cmd(ns, "storage", argv), stdout=out, stderr=subprocess.STDOUT, env=env)
        self.procs.append(p)
        return p

    def start(self) -> None:
        subprocess.run([str(TOPOLOGY), "up", str(self.n), str(self.rate)], check=True)
        weed = str(ROOT / ".venv/bin/weed")
        (self.dir / "s3.json").write_text(json.dumps({"identities": [{
            "name": "tensorgate", "credentials": [{"accessKey": AK, "secretKey": SK}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        for d in ["master", "filer"] + [f"volume{i}" for i in range(1, self.n + 1)]:
            (self.dir / d).mkdir(exist_ok=True)
        self.spawn("tgc-fabric", [weed, "master", f"-ip={FABRIC}", f"-port={MASTER_PORT}", f"-mdir={self.dir}/master",
                                  "-volumeSizeLimitMB=64", "-defaultReplication=000"], "master.log")
        for i in range(1, self.n + 1):
            self.spawn(f"tgc-node{i}", [weed, "volume", f"-ip={node_ip(i)}", f"-port={VOLUME_PORT}",
                                        f"-mserver={FABRIC}:{MASTER_PORT}", f"-dir={self.dir}/volume{i}", "-max=16",
                                        f"-rack=node{i}"], f"volume{i}.log")
        self.spawn("tgc-fabric", [weed, "filer", f"-ip={FABRIC}", f"-port={FILER_PORT}", f"-master={FABRIC}:{MASTER_PORT}",
                                  f"-defaultStoreDir={self.dir}/filer", "-s3", f"-s3.port={S3_PORT}", f"-s3.config={self.dir}/s3.json"], "filer.log")
        self.in_fabric([sys.executable, "-c", WAIT_S3, self.s3, AK, SK])

    def in_fabric(self, argv: list[str], stdin: bytes | None = None) -> None:
        subprocess.run(ns_cmd("tgc-fabric", "storage", argv), input=stdin, check=True)

    def upload(self, objects: dict[str, bytes]) -> None:
        """Written straight into the store over the back-plane (not over the nodes' links)."""
        self.in_fabric([sys.executable, "-c", UPLOAD, self.s3, AK, SK, BUCKET], stdin=dataset.tar_of(objects.items()))

    def start_gateways(self, forward: bool) -> None:
        """A fresh gateway (empty cache) on every node; `forward`: with the hop secret, so members
        forward pushdowns for objects they do not own to the owner."""
        import onnxruntime

        for g in self.gateways.values():
            g.terminate()
            g.wait(timeout=30)
            self.procs.remove(g)
        lib = next((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so*"))
        rows = ", ".join(f'{{ id = "{m["id"]}", s3 = "{m["s3"]}", admin = "{m["admin"]}" }}' for m in self.members)
        binary = os.environ.get("TENSORGATE_BIN") or str(ROOT / "target/release/tensorgate")
        for i, m in enumerate(self.members, 1):
            cfg = self.dir / f"gateway{i}.toml"
            cfg.write_text(
                f'[[credentials]]\naccess_key = "{KEY}"\nsecret_key = "{SECRET}"\n'
                "[pushdown]\nworkers = 1\nmax_batch = 16\nqueue_capacity = 1024\n"
                "[pushdown.cache]\nenabled = true\nmemory_bytes = 1073741824\n"
                f'[cluster]\nnode_id = "{m["id"]}"\nmembers = [{rows}]\nrefresh_secs = 1\nprobe_timeout_ms = 500\n'
                + ('secret_key = "cluster-hop-secret"\n' if forward else ""))
            env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
            env.update(TENSORGATE_CONFIG=str(cfg), TENSORGATE_LISTEN="0.0.0.0:9000", TENSORGATE_ADMIN_LISTEN="0.0.0.0:9001",
                       TENSORGATE_BACKEND_ENDPOINT=self.s3, TENSORGATE_BACKEND_ACCESS_KEY=AK,
                       TENSORGATE_BACKEND_SECRET_KEY=SK, TENSORGATE_MODELS_DIR=str(ROOT / "models"),
                       TENSORGATE_ORT_LIBRARY=str(lib), TENSORGATE_LOG="warn")
            self.gateways[i] = self.spawn(f"tgc-node{i}", [binary, "serve"], f"gateway{i}.log", env)
        subprocess.run(ns_cmd("tgc-compute", "client", [sys.executable, "-c", WAIT_CLUSTER, self.members[0]["admin"],
                                                  str(self.n)]), check=True)

    def epoch(self, keys: list[str], route: str, model: str | None = None, split: str | None = None,
              kill: int | None = None, kill_at: int = -1, seed: int = 0) -> dict:
        argv = [sys.executable, str(CLIENT), "--admin", self.members[0]["admin"], "--bucket", BUCKET,
                "--keys", ",".join(keys), "--route", route, "--threads", str(2 * self.n + 2), "--seed", str(seed)]
        if model:
            # Every member's engine started before the clock does (an engine start is seconds).
            argv += ["--model", model, "--split", split, "--warm", WARM]
        if kill:
            argv += ["--kill-pid", str(self.gateways[kill].pid), "--kill-at", str(kill_at)]
        before = self.link_bytes()
        out = subprocess.run(ns_cmd("tgc-compute", "client", argv), check=True, capture_output=True, text=True).stdout
        after = self.link_bytes()
        res = json.loads(out)
        res["link_bytes"] = {k: after[k] - before.get(k, 0) for k in after}
        return res

    def link_bytes(self) -> dict[str, int]:
        """Bytes received so far by the compute tier on each node's link."""
        links = json.loads(subprocess.run(["ip", "-n", "tgc-compute", "-s", "-j", "link", "show"], check=True,
                                          capture_output=True, text=True).stdout)
        return {ln["ifname"]: ln["stats64"]["rx"]["bytes"] for ln in links if ln["ifname"].startswith("tgc-c")}

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        subprocess.run([str(TOPOLOGY), "down"], check=False)


def hit_rate(res: dict) -> float:
    rows = res["rows"]
    return sum(r["cache"] in ("hit", "revalidated") for r in rows) / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="1,2,3")
    ap.add_argument("--rate", type=int, default=25, help="Mbit/s of each node's link")
    ap.add_argument("--shards", type=int, default=24)
    ap.add_argument("--per-shard", type=int, default=16)
    ap.add_argument("--model", default="resnet50-thin")
    ap.add_argument("--split", default="pool")
    ap.add_argument("--storage-cpus", default="0", help="taskset list for the storage tier (the client: CPU 1)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/cluster.jsonl"))
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/cluster/run.py: needs root (network namespaces); see docs/SCALING.md")
    # A SIGTERM (a `timeout` around the run) still stops every process and removes the namespaces.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench/cluster/run.py: terminated"))
    counts = [int(x) for x in a.nodes.split(",")]
    CPUS["storage"] = a.storage_cpus
    items = dataset.samples(a.shards * a.per_shard)
    objects = {f"train/{i:03d}.tar": s for i, s in enumerate(dataset.image_shards(items, a.per_shard))}
    keys = sorted(objects)
    objects[WARM] = objects[keys[0]]
    images = a.shards * a.per_shard
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    digests: dict[str, str] = {}
    rows = []

    def record(n: int, what: str, res: dict, **extra) -> dict:
        for r in res["rows"]:
            if what.startswith("pushdown") or what.startswith("raw"):
                want = digests.setdefault(("raw:" if what.startswith("raw") else "") + r["key"], r["digest"])
                assert r["digest"] == want, f"{what} with {n} nodes: {r['key']} differs from the first run"
        row = dict(commit=commit, storage_cpus=CPUS["storage"], nodes=n, rate=a.rate, what=what, images=images, seconds=round(res["seconds"], 3),
                   images_per_s=round(images / res["seconds"], 1), mbytes=round(res["bytes"] / 1e6, 2),
                   hit_rate=round(hit_rate(res), 3), link_mbytes={k: round(v / 1e6, 2) for k, v in res["link_bytes"].items()},
                   **extra)
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    with tempfile.TemporaryDirectory(prefix="tg-cluster-") as tmp:
        for n in counts:
            c = Cluster(n, a.rate, Path(tmp))
            try:
                c.start()
                c.upload(objects)
                c.start_gateways(forward=False)
                record(n, "raw", c.epoch(keys, "owner"))
                first = c.epoch(keys, "owner", a.model, a.split)
                record(n, f"pushdown {a.split}", first)
                if n != max(counts):
                    continue
                ids = [m["id"] for m in c.members]
                owners = {k: rank(ids, BUCKET, k)[0] for k in keys}
                assert all(r["by"] == owners[r["key"]] for r in first["rows"])
                # (a) epoch 2: routed to owners, then a client spreading its GETs at random, on fresh
                # gateways without and with forwarding.
                record(n, "pushdown epoch 2, routed", c.epoch(keys, "owner", a.model, a.split))
                for forward in (False, True):
                    c.start_gateways(forward=forward)
                    label = "spread, forwarding" if forward else "spread, no forwarding"
                    record(n, f"pushdown epoch 1, {label}", c.epoch(keys, "spread", a.model, a.split, seed=1))
                    res = c.epoch(keys, "spread", a.model, a.split, seed=2)
                    if forward:
                        assert all(r["by"] == owners[r["key"]] for r in res["rows"]), "a hop did not reach the owner"
                    record(n, f"pushdown epoch 2, {label}", res)
                # (b) warm every owner, then kill the last node's gateway halfway through an epoch.
                c.start_gateways(forward=False)
                c.epoch(keys, "owner", a.model, a.split)
                victim = f"node-{n}"
                res = c.epoch(keys, "owner", a.model, a.split, kill=n, kill_at=len(keys) // 2)
                # Requests in flight at the kill may still have been answered by the victim; every
                # one of its objects asked after the kill must be computed elsewhere, and nothing
                # else is recomputed.
                after = {r["key"] for r in res["rows"] if r["start"] > res["kill_time"]}
                lost = {k for k in after if owners[k] == victim}
                misses = {r["key"] for r in res["rows"] if r["cache"] == "miss"}
                assert misses <= {k for k in keys if owners[k] == victim}, (misses, victim)
                assert lost <= misses and not any(r["by"] == victim for r in res["rows"] if r["key"] in lost)
                record(n, f"pushdown epoch 3, {victim} killed mid-epoch", res, recomputed=len(misses),
                       victim_share=sum(owners[k] == victim for k in keys), lost=len(lost))
            finally:
                c.stop()
    report(rows, a)


def report(rows: list[dict], a) -> None:
    lines = [f"# Scale-out under per-node links (bench/cluster/run.py, commit {rows[0]['commit']})", "",
             f"{a.shards} shards x {a.per_shard} JPEGs, {a.model} at `{a.split}`, each node's link {a.rate} Mbit/s; "
             f"storage tier on CPUs {a.storage_cpus}, client on CPU 1.", "",
             "| nodes | run | seconds | images/s | MB to the client | epoch hits | per link MB |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        links = " / ".join(f"{v:g}" for _, v in sorted(r["link_mbytes"].items()))
        extra = f" (recomputed {r['recomputed']} of the victim's {r['victim_share']})" if "recomputed" in r else ""
        lines.append(f"| {r['nodes']} | {r['what']}{extra} | {r['seconds']:.1f} | {r['images_per_s']:g} | {r['mbytes']:g} "
                     f"| {r['hit_rate']:.2f} | {links} |")
    Path(a.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
