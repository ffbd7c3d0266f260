"""Batch-adaptation experiment (HAPI section 3, scaled to this machine).

1, 2, 4 and 8 tenants (one access key each) stream WebDataset shards of 64 JPEGs (~105 kB,
bench/dataset.py) as ResNet-18 `layer1` pushdowns, each asking for a storage batch of 64 (a whole
shard at once), all at the same time. Three gateway modes, a fresh gateway per point:

  unconstrained  adaptation on, a 16 GiB budget (nothing is ever deferred)
  adaptive       adaptation on, pushdown.memory_budget = BUDGET (too small for 8 x 64 samples)
  fixed          adaptation off (HAPI without adaptation: the requested batch runs as one batch),
                 the same BUDGET configured but not enforced

Pinned (bench/pinning.py): the gateway on the last core, the tenants' clients on the others.
Reported per point: requests completed / failed (503), samples/s, the gateway's CPU per sample,
peak RSS of the gateway (VmHWM) and its baseline before the burst, and the governor's peak
reservation.

Run: .venv/bin/python bench/adaptation.py   (after scripts/setup.sh, scripts/models.sh and
     cargo build --release); BUDGET_MIB=512 SHARDS=2 by default.
"""

import concurrent.futures as cf
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import boto3
import urllib3
from botocore.config import Config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "bench"))
import dataset  # noqa: E402
import conftest  # noqa: E402
import pinning  # noqa: E402

BUDGET = int(os.environ.get("BUDGET_MIB", "512")) << 20
SHARDS = int(os.environ.get("SHARDS", "2"))
PER_SHARD, BATCH = 64, 64
MODEL, SPLIT = "resnet18", "layer1"
TENANTS = [1, 2, 4, 8]
conftest.BINARY = ROOT / "target" / "release" / "tensorgate"


def status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    return 0


def client(endpoint, key):
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id=key, aws_secret_access_key=f"{key}-secret",
        region_name="us-east-1", config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )


def point(mode: str, tenants: int, shards: list[bytes], workdir: Path) -> dict:
    budget = 16 << 30 if mode == "unconstrained" else BUDGET
    creds = "".join(f'[[credentials]]\naccess_key = "tenant{t}"\nsecret_key = "tenant{t}-secret"\n' for t in range(8))
    cfg = (f"{creds}[pushdown]\nmemory_budget = {budget}\nadaptation = {'false' if mode == 'fixed' else 'true'}\n"
           f"max_wait_ms = 120000\nqueue_capacity = 1024\n[pushdown.cache]\nenabled = false\n")
    with conftest.run_gateway(workdir, cfg) as (endpoint, admin, _, pid):
        pinning.pin_gateway(pid)
        admin_client = client(endpoint, "tenant0")
        admin_client.create_bucket(Bucket="data")
        for i, shard in enumerate(shards):
            admin_client.put_object(Bucket="data", Key=f"shard-{i:03d}.tar", Body=shard)
        http = urllib3.PoolManager(maxsize=16, timeout=urllib3.Timeout(total=300))
        headers = {"x-tensorgate-model": MODEL, "x-tensorgate-split": SPLIT, "x-tensorgate-batch": str(BATCH)}
        # Warm-up: start the engine (memory probe) so the burst measures steady state.
        warm = admin_client.generate_presigned_url("get_object", Params={"Bucket": "data", "Key": "shard-000.tar"})
        assert http.request("GET", warm, headers={**headers, "x-tensorgate-batch": "1"}).status == 200
        baseline = status_bytes(pid, "VmRSS:")
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        peak_reserved, done = [0], threading.Event()

        def watch():
            while not done.is_set():
                with urllib.request.urlopen(f"{admin}/v1/memory") as r:
                    peak_reserved[0] = max(peak_reserved[0], json.load(r)["reserved_bytes"])
                time.sleep(0.05)

        def tenant(t):
            c = client(endpoint, f"tenant{t}")
            ok = failed = 0
            for i in range(len(shards)):
                url = c.generate_presigned_url("get_object", Params={"Bucket": "data", "Key": f"shard-{i:03d}.tar"})
                r = http.request("GET", url, headers=headers, retries=False)
                ok, failed = (ok + 1, failed) if r.status == 200 else (ok, failed + 1)
            return ok, failed

        watcher = threading.Thread(target=watch)
        watcher.start()
        t0, c0 = time.perf_counter(), pinning.cpu_seconds(pid)
        with cf.ThreadPoolExecutor(tenants) as pool:
            results = list(pool.map(tenant, range(tenants)))
        elapsed, cpu = time.perf_counter() - t0, pinning.cpu_seconds(pid) - c0
        done.set()
        watcher.join()
        ok = sum(r[0] for r in results)
        return {
            "mode": mode, "tenants": tenants, "ok": ok, "failed": sum(r[1] for r in results),
            "sps": ok * PER_SHARD / elapsed, "baseline": baseline, "peak": status_bytes(pid, "VmHWM:"),
            "reserved": peak_reserved[0], "cpu_ms": cpu / max(1, ok * PER_SHARD) * 1e3,
        }


def main():
    pinning.pin_rest()
    items = dataset.samples(PER_SHARD * SHARDS)
    shards = dataset.image_shards(items, PER_SHARD)
    rows = []
    for mode in ("unconstrained", "adaptive", "fixed"):
        for tenants in TENANTS:
            rows.append(point(mode, tenants, shards, Path(tempfile.mkdtemp(prefix="adapt-"))))
            print(rows[-1], file=sys.stderr)
    mib = lambda b: b / (1 << 20)  # noqa: E731
    print(f"\n{MODEL} at {SPLIT}, shards of {PER_SHARD} JPEGs, storage batch requested {BATCH}, "
          f"{SHARDS} shards per tenant, budget {mib(BUDGET):.0f} MiB, {os.cpu_count()} cores, {pinning.describe()}\n")
    print("| mode | tenants | requests ok / failed | samples/s | vs unconstrained | gateway CPU ms / sample | baseline RSS (MiB) | peak RSS (MiB) | peak - baseline (MiB) | peak reserved (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    free = {r["tenants"]: r["sps"] for r in rows if r["mode"] == "unconstrained"}
    for r in rows:
        print(f"| {r['mode']} | {r['tenants']} | {r['ok']} / {r['failed']} | {r['sps']:.0f} | {r['sps'] / free[r['tenants']]:.2f} | {r['cpu_ms']:.1f} | "
              f"{mib(r['baseline']):.0f} | {mib(r['peak']):.0f} | {mib(r['peak'] - r['baseline']):.0f} | {mib(r['reserved']):.0f} |")


if __name__ == "__main__":
    main()
