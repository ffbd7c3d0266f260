"""Single-image clients at once against one engine: do the samples of concurrent
requests batch together as well as one request's samples do?

The same 64 JPEGs (synthetic 500x375 photos) pushed down through one gateway (release build, fs
backend, cache off, one inference worker with one intra-op thread, the gateway alone on the last
core), two ways, alternated ROUNDS times:
- `singles`: CLIENTS concurrent clients, each GETting its share of the JPEGs one request per image;
- `shards`: the same JPEGs as 4 WebDataset shards of 16, one request per shard, one at a time, so
  the engine runs each shard's samples in batches of up to 16 (its best batch on this machine's
  floor runs is 8-16: docs/BENCHMARKS.md).
Reported: images/s of each, their ratio (singles / shards, the bar is >= 0.9), the mean batch the
engine ran (`tensorgate_pushdown_batch_size`), and the gateway's CPU ms per image.

Run: .venv/bin/python bench/single_clients.py   (after scripts/setup.sh, scripts/models.sh and a
     release build; TENSORGATE_BIN=... another build, BENCH_MODELS=resnet18 a subset,
     CLIENTS=16, ROUNDS=2)
"""

import concurrent.futures as cf
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import boto3

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "bench"))

from conftest import free_port, ort_library, wait_ready  # noqa: E402
from pinning import GATEWAY_CPUS, cpu_seconds, describe, pin_gateway, pin_rest  # noqa: E402
from pushdown import jpegs  # noqa: E402
from test_pushdown import tar_of  # noqa: E402

BINARY = Path(os.environ.get("TENSORGATE_BIN", ROOT / "target/release/tensorgate"))
CLIENTS = int(os.environ.get("CLIENTS", "16"))
ROUNDS = int(os.environ.get("ROUNDS", "2"))
N, SHARD = 64, 16
MODELS = {"resnet18": "pool", "pp-lcnet": "pool", "resnet50-thin": "pool"}
MODELS = {m: s for m, s in MODELS.items() if m in os.environ.get("BENCH_MODELS", ",".join(MODELS)).split(",")}


def batch_stats(admin: str) -> tuple[float, float]:
    """(sum, count) of the engine batch-size histogram, over every (model, split)."""
    with urllib.request.urlopen(f"{admin}/metrics") as r:
        text = r.read().decode()
    total = sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("tensorgate_pushdown_batch_size_sum"))
    count = sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("tensorgate_pushdown_batch_size_count"))
    return total, count


def main() -> None:
    images = jpegs(N, first_seed=3000)
    tmp = Path(tempfile.mkdtemp())
    port, admin_port = free_port(), free_port()
    admin = f"http://127.0.0.1:{admin_port}"
    cfg = tmp / "gw.toml"
    cfg.write_text(f"[pushdown]\nintra_threads = 1\nworkers = 1\nmemory_budget = {4 << 30}\n"
                   "[pushdown.cache]\nenabled = false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
    env.update(TENSORGATE_CONFIG=str(cfg), TENSORGATE_LISTEN=f"127.0.0.1:{port}",
               TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin_port}", TENSORGATE_BACKEND_ROOT=str(tmp / "data"),
               TENSORGATE_MODELS_DIR=str(ROOT / "models"), TENSORGATE_ORT_LIBRARY=ort_library(), TENSORGATE_LOG="warn")
    proc = subprocess.Popen([str(BINARY)], env=env)
    rows = []
    try:
        wait_ready(admin, proc)
        pin_gateway(proc.pid)
        pin_rest()
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="tensorgate-dev",
                          aws_secret_access_key="tensorgate-dev-secret", region_name="us-east-1")
        s3.create_bucket(Bucket="bench")
        for i, data in enumerate(images):
            s3.put_object(Bucket="bench", Key=f"img/{i}.jpg", Body=data)
        for s in range(N // SHARD):
            members = [(f"{i:04d}.jpg", images[i]) for i in range(s * SHARD, (s + 1) * SHARD)]
            s3.put_object(Bucket="bench", Key=f"shard/{s}.tar", Body=tar_of(members))

        def url(key: str, model: str, split: str) -> str:
            return (s3.generate_presigned_url("get_object", Params={"Bucket": "bench", "Key": key}, ExpiresIn=3600)
                    + f"&tensorgate-model={model}&tensorgate-split={split}")

        def fetch(u: str) -> int:
            with urllib.request.urlopen(u, timeout=600) as r:
                return len(r.read())

        for model, split in MODELS.items():
            singles = [url(f"img/{i}.jpg", model, split) for i in range(N)]
            shards = [url(f"shard/{s}.tar", model, split) for s in range(N // SHARD)]
            fetch(shards[0])  # the engine started, measured and warm
            for _ in range(ROUNDS):
                for way in ("singles", "shards"):
                    before, cpu0, t = batch_stats(admin), cpu_seconds(proc.pid), time.perf_counter()
                    if way == "singles":
                        with cf.ThreadPoolExecutor(CLIENTS) as ex:
                            list(ex.map(fetch, singles))
                    else:
                        for u in shards:
                            fetch(u)
                    secs, cpu = time.perf_counter() - t, cpu_seconds(proc.pid) - cpu0
                    after = batch_stats(admin)
                    mean_batch = (after[0] - before[0]) / max(1.0, after[1] - before[1])
                    rows.append((model, split, way, N / secs, mean_batch, cpu / N * 1e3))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"{N} JPEGs 500x375; {CLIENTS} concurrent single-image clients vs {N // SHARD} shards of {SHARD}; "
          f"{describe()} (gateway CPUs {sorted(GATEWAY_CPUS)}); {ROUNDS} alternations\n")
    print("| model | split | way | images/s | mean engine batch | gateway CPU ms / image |")
    print("|---|---|---|---|---|---|")
    for model, split, way, rate, batch, cpu in rows:
        print(f"| {model} | {split} | {way} | {rate:.1f} | {batch:.2f} | {cpu:.1f} |")
    print("\n| model | split | singles / shards (per alternation) |")
    print("|---|---|---|")
    for model, split in MODELS.items():
        mine = [r for r in rows if r[0] == model]
        ratios = [mine[i][3] / mine[i + 1][3] for i in range(0, len(mine), 2)]
        print(f"| {model} | {split} | {', '.join(f'{x:.2f}' for x in ratios)} |")


if __name__ == "__main__":
    main()
