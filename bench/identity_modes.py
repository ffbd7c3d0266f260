"""Pushdown in the two identity modes (ADR 0013), one release binary, in one run, in front of one
SeaweedFS: what transparent mode costs over terminating mode.

- Cache hits, added latency: one cached output read REQUESTS times by one client through
  (a) terminating mode with a trust window (`revalidate_after_ms` = 10 min: no store round trip),
  (b) terminating mode as configured by default (`revalidate_after_ms = 0`: a conditional GET
  signed with the store key on every hit), (c) transparent mode (the caller's own signed GET with
  an added If-None-Match on every hit). Sides alternate per round; p50 and p99 over all rounds.
- Cache misses, throughput: the cache off, 48 JPEGs through ResNet-18 at `pool` by 4 client
  threads, terminating vs transparent, alternating ROUNDS times; images/s medians and the ratio.

Each gateway is alone on the last core (bench/pinning.py), SeaweedFS and the client on the others.

    .venv/bin/python bench/identity_modes.py            # ROUNDS=5 REQUESTS=200
"""

import concurrent.futures as cf
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import boto3
from botocore.config import Config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from conftest import free_port, ort_library, wait_ready  # noqa: E402
from pinning import pin_gateway, pin_rest  # noqa: E402
from pushdown import jpegs  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "5"))
REQUESTS = int(os.environ.get("REQUESTS", "200"))
PORT = 18833  # SeaweedFS for this benchmark (and the next 4 ports, and +10000)
AK, SK = "seaweed-ak", "seaweed-sk"
MODEL, SPLIT = "resnet18", "pool"
BINARY = os.environ.get("GATEWAY_BIN", str(ROOT / "target" / "release" / "tensorgate"))


def start(tmp: Path, name: str, store: str, config: str, keys: bool):
    port, admin = free_port(), free_port()
    cfg = tmp / f"{name}.toml"
    cfg.write_text(f"[pushdown]\nintra_threads = 1\nworkers = 1\nmemory_budget = {4 << 30}\n{config}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORGATE_", "AWS_"))}
    env.update(TENSORGATE_CONFIG=str(cfg), TENSORGATE_LISTEN=f"127.0.0.1:{port}",
               TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin}", TENSORGATE_BACKEND_ENDPOINT=store,
               TENSORGATE_MODELS_DIR=str(ROOT / "models"), TENSORGATE_ORT_LIBRARY=ort_library(),
               TENSORGATE_LOG="warn")
    ak, sk = AK, SK
    if keys:  # terminating: a client key of the gateway's, the store key behind it
        env.update(TENSORGATE_BACKEND_ACCESS_KEY=AK, TENSORGATE_BACKEND_SECRET_KEY=SK,
                   TENSORGATE_ACCESS_KEY="bench-ak", TENSORGATE_SECRET_KEY="bench-sk")
        ak, sk = "bench-ak", "bench-sk"
    proc = subprocess.Popen([BINARY, "serve"], env=env)
    wait_ready(f"http://127.0.0.1:{admin}", proc)
    pin_gateway(proc.pid)
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id=ak, aws_secret_access_key=sk,
                      region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
    return proc, s3


def pushdown_urls(s3, keys):
    return [s3.generate_presigned_url("get_object", Params={"Bucket": "bench", "Key": k}, ExpiresIn=3600)
            + f"&tensorgate-model={MODEL}&tensorgate-split={SPLIT}" for k in keys]


def get(url):
    with urllib.request.urlopen(url) as r:
        return r.headers.get("x-tensorgate-cache"), len(r.read())


def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    env = dict(os.environ, SEAWEED_PORT=str(PORT))
    store = subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "start"], env=env, check=True, capture_output=True,
                           text=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp())
    procs = []
    try:
        direct = boto3.client("s3", endpoint_url=store, aws_access_key_id=AK, aws_secret_access_key=SK,
                              region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))
        direct.create_bucket(Bucket="bench")
        images = jpegs()
        for i, j in enumerate(images):
            direct.put_object(Bucket="bench", Key=f"{i}.jpg", Body=j)
        hit_sides = {
            "terminating, trust window": start(tmp, "trust", store, "[pushdown.cache]\nrevalidate_after_ms = 600000", True),
            "terminating (default)": start(tmp, "term", store, "", True),
            "transparent": start(tmp, "transp", store, "", False),
        }
        miss_sides = {
            "terminating": start(tmp, "term-nc", store, "[pushdown.cache]\nenabled = false", True),
            "transparent": start(tmp, "transp-nc", store, "[pushdown.cache]\nenabled = false", False),
        }
        procs = [p for p, _ in list(hit_sides.values()) + list(miss_sides.values())]
        pin_rest()

        print(f"Cache hits: one cached {MODEL}/{SPLIT} output, {REQUESTS} sequential GETs per side per round, "
              f"{ROUNDS} rounds\n")
        urls = {n: pushdown_urls(s3, ["0.jpg"])[0] for n, (_, s3) in hit_sides.items()}
        for n, u in urls.items():
            get(u)  # computes and caches
        lat = {n: [] for n in hit_sides}
        states = {n: set() for n in hit_sides}
        for _ in range(ROUNDS):
            for n, u in urls.items():
                for _ in range(REQUESTS):
                    t = time.perf_counter()
                    state, _ = get(u)
                    lat[n].append((time.perf_counter() - t) * 1e3)
                    states[n].add(state)
        base = statistics.median(lat["terminating, trust window"])
        print("| side | served as | p50 ms | p99 ms | p50 added over the trust window, ms |")
        print("|---|---|---|---|---|")
        for n in hit_sides:
            p50, p99 = quantile(lat[n], 0.5), quantile(lat[n], 0.99)
            print(f"| {n} | {', '.join(sorted(s or '-' for s in states[n]))} | {p50:.2f} | {p99:.2f} | {p50 - base:+.2f} |")

        print(f"\nCache misses: {len(images)} JPEGs, {MODEL}/{SPLIT}, 4 client threads, cache off, {ROUNDS} rounds\n")
        urls = {n: pushdown_urls(s3, [f"{i}.jpg" for i in range(len(images))]) for n, (_, s3) in miss_sides.items()}
        for n, u in urls.items():
            get(u[0])  # the engine starts
        rate = {n: [] for n in miss_sides}
        for _ in range(ROUNDS):
            for n, u in urls.items():
                t = time.perf_counter()
                with cf.ThreadPoolExecutor(4) as ex:
                    list(ex.map(get, u))
                rate[n].append(len(u) / (time.perf_counter() - t))
        a, b = statistics.median(rate["terminating"]), statistics.median(rate["transparent"])
        print("| terminating img/s | transparent img/s | transparent / terminating |")
        print("|---|---|---|")
        print(f"| {a:.1f} | {b:.1f} | {b / a:.3f} |")
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)
        subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "stop"], env=env, check=False)


if __name__ == "__main__":
    main()
