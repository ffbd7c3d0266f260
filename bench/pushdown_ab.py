"""A/B of two gateway builds or environments on pushdown, alternating quickly enough that a noisy
machine moves both sides alike: both gateways run at once (each alone on the last core, one
inference worker, an fs backend with the same 48 synthetic 500x375 JPEGs, a 4 GiB budget so the
budget is no variable, the cache off), and for each (model, split) the client (on the other
cores, 4 threads) fetches every image from A, then from B, ROUNDS times (B first in every other
round, so neither side always runs second). Reported per row:
images/s and the gateway's CPU milliseconds per image (user + system from /proc, so time the
core spent on something else is not counted), medians over the rounds, and B / A.

    A=/path/to/tensorgate-a B=/path/to/tensorgate-b .venv/bin/python bench/pushdown_ab.py
    ROUNDS=7 BENCH_MODELS=pp-lcnet ...      more rounds, fewer models
    B_PUSHDOWN='ort_arena = "per-run"' ...  lines added to one side's [pushdown] section

A and B may be wrapper scripts that set an environment and `exec` the binary (the process id is
then the gateway's). Used for ADR 0012 (huge pages); docs/BENCHMARKS.md has its results."""

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "bench"))
from conftest import free_port, ort_library, wait_ready  # noqa: E402
from pinning import cpu_seconds, pin_gateway, pin_rest  # noqa: E402
from pushdown import MODELS, jpegs  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "5"))
BUCKET = "bench"


def start(binary: str, tmp: Path, name: str):
    port, admin = free_port(), free_port()
    cfg = tmp / f"{name}.toml"
    extra = os.environ.get(f"{name}_PUSHDOWN", "")
    cfg.write_text(f"[pushdown]\nintra_threads = 1\nworkers = 1\nmemory_budget = {4 << 30}\n{extra}\n"
                   "[pushdown.cache]\nenabled = false\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORGATE_", "GLIBC_TUNABLES"))}
    env.update(TENSORGATE_CONFIG=str(cfg), TENSORGATE_LISTEN=f"127.0.0.1:{port}",
               TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin}", TENSORGATE_BACKEND_ROOT=str(tmp / name),
               TENSORGATE_MODELS_DIR=str(ROOT / "models"), TENSORGATE_ORT_LIBRARY=ort_library(),
               TENSORGATE_LOG="warn")
    proc = subprocess.Popen([binary], env=env)
    wait_ready(f"http://127.0.0.1:{admin}", proc)
    pin_gateway(proc.pid)
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="tensorgate-dev",
                      aws_secret_access_key="tensorgate-dev-secret", region_name="us-east-1")
    return proc, s3


def main():
    images = jpegs()
    tmp = Path(tempfile.mkdtemp())
    sides = {}
    try:
        for name in ("A", "B"):
            sides[name] = start(os.environ[name], tmp, name)
            s3 = sides[name][1]
            s3.create_bucket(Bucket=BUCKET)
            for i, j in enumerate(images):
                s3.put_object(Bucket=BUCKET, Key=f"{i}.jpg", Body=j)
        pin_rest()
        for name in sides:
            print(f"{name} = {os.environ[name]} {os.environ.get(name + '_PUSHDOWN', '')}")
        print(f"\n{len(images)} JPEGs, {ROUNDS} rounds, medians\n")
        print("| model | split | A img/s | B img/s | B / A | A CPU ms/img | B CPU ms/img | B / A CPU |")
        print("|---|---|---|---|---|---|---|---|")
        for model, splits in MODELS.items():
            for split in splits:
                urls = {}
                for name, (_, s3) in sides.items():
                    urls[name] = [s3.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": f"{i}.jpg"},
                                                            ExpiresIn=3600)
                                  + f"&tensorgate-model={model}&tensorgate-split={split}" for i in range(len(images))]

                def get(url):
                    with urllib.request.urlopen(url) as r:
                        return len(r.read())
                for name in sides:
                    get(urls[name][0])  # warm-up: the engine starts and is checked
                rate, cpu = {n: [] for n in sides}, {n: [] for n in sides}
                for r in range(ROUNDS):
                    # A then B in even rounds, B then A in odd ones: whichever side runs second
                    # in a round (a warmer core, caches) is not always the same one.
                    for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                        proc = sides[name][0]
                        c, t = cpu_seconds(proc.pid), time.perf_counter()
                        with cf.ThreadPoolExecutor(4) as ex:
                            list(ex.map(get, urls[name]))
                        rate[name].append(len(images) / (time.perf_counter() - t))
                        cpu[name].append((cpu_seconds(proc.pid) - c) / len(images) * 1e3)
                a, b = statistics.median(rate["A"]), statistics.median(rate["B"])
                ca, cb = statistics.median(cpu["A"]), statistics.median(cpu["B"])
                print(f"| {model} | {split} | {a:.1f} | {b:.1f} | {b / a:.2f} | {ca:.2f} | {cb:.2f} | {cb / ca:.2f} |",
                      flush=True)
    finally:
        for proc, _ in sides.values():
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
