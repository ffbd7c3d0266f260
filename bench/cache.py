"""Tensor cache benchmark (ADR 0004): two epochs of ResNet-18 `layer4` pushdowns over N synthetic
ImageNet-sized JPEGs (bench/dataset.py, ~105 kB) through the release gateway on SeaweedFS.

Runs, each on a fresh gateway (cold cache):
  fits        memory tier larger than the dataset's tensors; WebDataset shards of 100 samples
  objects     the same, one object per JPEG (per-request costs dominate epoch 2)
  1.5x        memory tier = tensors / 1.5, no disk tier (shards)
  objects, trusted   one object per JPEG, revalidate_after_ms = 60000
  1.5x+disk   the same with a disk tier big enough for everything (shards)

All runs but one use the default freshness rule: each request sends one conditional GET to the
store; the other trusts validated entries for a minute (writes through the gateway still count).
Epoch 2's bytes are compared with epoch 1's. Pinned (bench/pinning.py): the gateway on the last
core, SeaweedFS and the client threads on the others; the gateway's CPU per sample is reported for
each epoch. Printed as markdown.

Run: .venv/bin/python bench/cache.py   (after scripts/setup.sh, scripts/models.sh and
     cargo build --release); N_IMAGES=2000 by default.
"""

import concurrent.futures as cf
import hashlib
import os
import subprocess
import sys
import tempfile
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

conftest.BINARY = ROOT / "target" / "release" / "tensorgate"

N_IMAGES = int(os.environ.get("N_IMAGES", "2000"))
PER_SHARD = 100
SEAWEED_PORT = 18733
MODEL, SPLIT = "resnet18", "layer4"
THREADS = 4
BUCKET = "cachebench"
# 512 x 7 x 7 f32 per sample, plus headers.
TENSOR_BYTES = 512 * 7 * 7 * 4


def metrics(admin: str) -> dict:
    with urllib.request.urlopen(f"{admin}/metrics") as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def total(m: dict, prefix: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(prefix))


class Gateway:
    """The release gateway on SeaweedFS (conftest.run_gateway) with a presigning client."""

    def __init__(self, seaweed: str, workdir: Path, cache_toml: str):
        self._running = conftest.run_gateway(workdir, cache_toml, seaweed=seaweed, env={"TENSORGATE_LOG": "warn"})
        _, self.admin, client, self.pid = self._running.__enter__()
        pinning.pin_gateway(self.pid)
        self.s3 = boto3.client(
            "s3", endpoint_url=client.meta.endpoint_url, aws_access_key_id="tensorgate-dev",
            aws_secret_access_key="tensorgate-dev-secret", region_name="us-east-1",
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
        )
        # No retries: a refused request must show, not be hidden in the timing.
        self.http = urllib3.PoolManager(maxsize=THREADS, retries=False)

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def epoch(self, keys: list[str]):
        """Reads every key once (THREADS at a time); returns (seconds, bytes, digest per key)."""
        urls = [self.s3.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": k}, ExpiresIn=3600) for k in keys]
        headers = {"x-tensorgate-model": MODEL, "x-tensorgate-split": SPLIT}

        def one(url):
            r = self.http.request("GET", url, headers=headers, preload_content=True)
            assert r.status == 200, (r.status, r.data[:300])
            return hashlib.sha256(r.data).hexdigest(), len(r.data)

        t = time.perf_counter()
        with cf.ThreadPoolExecutor(THREADS) as pool:
            got = list(pool.map(one, urls))
        return time.perf_counter() - t, sum(n for _, n in got), [d for d, _ in got]

    def close(self):
        self._running.__exit__(None, None, None)


def run(name, seaweed, workdir, cache_toml, keys, samples_per_key):
    gw = Gateway(seaweed, workdir, cache_toml)
    try:
        c0 = pinning.cpu_seconds(gw.pid)
        t1, _, d1 = gw.epoch(keys)
        c1 = pinning.cpu_seconds(gw.pid)
        before = metrics(gw.admin)
        t2, bytes2, d2 = gw.epoch(keys)
        after = metrics(gw.admin)
        c2 = pinning.cpu_seconds(gw.pid)
        hits = total(after, "tensorgate_cache_hits_total") - total(before, "tensorgate_cache_hits_total")
        by_tier = {t: total(after, f'tensorgate_cache_hits_total{{tier="{t}"}}') - total(before, f'tensorgate_cache_hits_total{{tier="{t}"}}') for t in ("memory", "disk")}
        n = len(keys) * samples_per_key
        return {
            "run": name, "epoch1": t1, "epoch2": t2, "identical": d1 == d2,
            "hit": hits / len(keys), "mem": by_tier["memory"] / len(keys), "disk": by_tier["disk"] / len(keys),
            "sps": n / t2, "gbps": bytes2 / t2 / 1e9, "rss": gw.peak_rss_mib(),
            "cpu1": (c1 - c0) / n * 1e3, "cpu2": (c2 - c1) / n * 1e3,
        }
    finally:
        gw.close()


def main():
    env = dict(os.environ, SEAWEED_PORT=str(SEAWEED_PORT))
    seaweed = subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "start"], env=env, check=True, capture_output=True, text=True).stdout.strip()
    pinning.pin_rest(int((ROOT / f".tmp/seaweedfs-{SEAWEED_PORT}/pid").read_text()))
    try:
        direct = boto3.client("s3", endpoint_url=seaweed, aws_access_key_id="seaweed-ak", aws_secret_access_key="seaweed-sk", region_name="us-east-1")
        direct.create_bucket(Bucket=BUCKET)
        items = dataset.samples(N_IMAGES)
        mean_kb = sum(len(d) for _, _, d in items) / len(items) / 1e3
        objects = []
        for key, _, data in items:
            direct.put_object(Bucket=BUCKET, Key=f"img/{key}.jpg", Body=data)
            objects.append(f"img/{key}.jpg")
        shards = []
        for i, shard in enumerate(dataset.image_shards(items, PER_SHARD)):
            direct.put_object(Bucket=BUCKET, Key=f"shards/{i:05d}.tar", Body=shard)
            shards.append(f"shards/{i:05d}.tar")
        tensors = N_IMAGES * TENSOR_BYTES
        workdir = Path(tempfile.mkdtemp(prefix="cachebench-"))
        # Room for every client's shard in the inference queue (4 x 100 samples): a refused
        # request would time the client's retry back-off, not the gateway.
        queue = "[pushdown]\nqueue_capacity = 512\n"
        big = queue + f"[pushdown.cache]\nmemory_bytes = {2 * tensors + (64 << 20)}\n"
        small = queue + f"[pushdown.cache]\nmemory_bytes = {int(tensors / 1.5)}\n"
        disk = small + f'disk_dir = "{workdir / "disk"}"\ndisk_bytes = {2 * tensors + (64 << 20)}\n'
        rows = [
            run("fits (shards of 100)", seaweed, workdir, big, shards, PER_SHARD),
            run("fits (one object per JPEG)", seaweed, workdir, big, objects, 1),
            run("fits (one object per JPEG), revalidate_after_ms = 60000", seaweed, workdir,
                big + "revalidate_after_ms = 60000\n", objects, 1),
            run("1.5x memory, no disk (shards)", seaweed, workdir, small, shards, PER_SHARD),
            run("1.5x memory + disk tier (shards)", seaweed, workdir, disk, shards, PER_SHARD),
        ]
        print(f"\n{N_IMAGES} JPEGs (mean {mean_kb:.0f} kB), {MODEL} at {SPLIT} ({TENSOR_BYTES / 1e3:.0f} kB per sample), "
              f"{THREADS} client threads, {os.cpu_count()} cores, {pinning.describe()}\n")
        print("| run | epoch 1 (s) | epoch 2 (s) | epoch 1 / epoch 2 | epoch 2 hits (memory / disk) | epoch 2 samples/s | epoch 2 GB/s | gateway CPU ms / sample, epoch 1 / 2 | identical | peak RSS (MiB) |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['run']} | {r['epoch1']:.1f} | {r['epoch2']:.2f} | **{r['epoch1'] / r['epoch2']:.1f}x** | "
                  f"{100 * r['hit']:.0f}% ({100 * r['mem']:.0f}% / {100 * r['disk']:.0f}%) | {r['sps']:.0f} | {r['gbps']:.2f} | "
                  f"{r['cpu1']:.1f} / {r['cpu2']:.2f} | "
                  f"{'yes' if r['identical'] else 'NO'} | {r['rss']:.0f} |")
    finally:
        subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "stop"], env=env, check=False)


if __name__ == "__main__":
    main()
