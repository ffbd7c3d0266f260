"""A/B of two gateway builds on one whole shard per request, the case where an engine runs full
batches back to back: both gateways run at once, each alone on the last core (default config but
the cache off, an fs backend holding the same shard of 240 synthetic 500x375 JPEGs), and for each
model the client fetches the shard's `pool` features from A, then from B, ROUNDS times (after one
warm-up request each). Reported per row, medians over the rounds: the gateway's minor page faults
per image, its CPU milliseconds per image (user + system from /proc, so time the core spent on
something else is not counted) and images/s; then B / A.

    A=/path/to/tensorgate-a B=/path/to/tensorgate-b .venv/bin/python bench/shard_faults.py
    ROUNDS=5 BENCH_MODELS=resnet18 ...
    PIN=0 ...      nothing pinned: the gateways size their threads for every core and share them

Used for ADR 0024 (the per-run arena kept between full batches); docs/BENCHMARKS.md has its
results."""

import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "bench"))
import conftest  # noqa: E402
from pinning import cpu_seconds, pin_gateway, pin_rest  # noqa: E402
from pushdown import jpeg_shard  # noqa: E402

from tensorgate import Client  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "3"))
MODELS = os.environ.get("BENCH_MODELS", "resnet50-thin,resnet18,pp-lcnet").split(",")
N = 240
PIN = os.environ.get("PIN", "1") != "0"


def usage(pid: int) -> tuple[int, float]:
    """Minor faults (field 10 of /proc/PID/stat) and CPU seconds of `pid` so far."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7]), cpu_seconds(pid)


def main():
    sides = {"A": os.environ["A"], "B": os.environ["B"]}
    body = jpeg_shard(N)
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        gateways = {}
        for name, binary in sides.items():
            conftest.BINARY = Path(binary)  # run_gateway starts the binary named here
            d = Path(tmp) / name
            d.mkdir()
            endpoint, admin, s3, pid = stack.enter_context(
                conftest.run_gateway(d, "[pushdown.cache]\nenabled = false\n"))
            if PIN:
                pin_gateway(pid)
            s3.create_bucket(Bucket="faults")
            s3.put_object(Bucket="faults", Key="s.tar", Body=body)
            gateways[name] = (Client(endpoint, "tensorgate-dev", "tensorgate-dev-secret", admin=admin), pid)
        if PIN:
            pin_rest(os.getpid())
        where = "each gateway alone on the last core" if PIN else "nothing pinned"
        print(f"{N} images in one shard per request, {ROUNDS} rounds, {where}, A={sides['A']}, B={sides['B']}\n")
        print("| model | side | faults / image | CPU ms / image | images/s |")
        print("|---|---|---|---|---|")
        ratios = []
        for model in MODELS:
            got = {name: [] for name in sides}
            for client, _ in gateways.values():
                client.get("faults", "s.tar", model, "pool")  # the engine's start, outside the rounds
            for _ in range(ROUNDS):
                for name, (client, pid) in gateways.items():
                    (f0, c0), t = usage(pid), time.perf_counter()
                    client.get("faults", "s.tar", model, "pool")
                    wall = time.perf_counter() - t
                    f1, c1 = usage(pid)
                    got[name].append(((f1 - f0) / N, (c1 - c0) / N * 1000, N / wall))
            med = {name: [statistics.median(r[i] for r in rows) for i in range(3)] for name, rows in got.items()}
            for name in sides:
                faults, cpu, rate = med[name]
                print(f"| {model} | {name} | {faults:.0f} | {cpu:.1f} | {rate:.1f} |")
            ratios.append((model, *(med["B"][i] / med["A"][i] for i in range(3))))
        print("\n| model | faults B / A | CPU B / A | images/s B / A |\n|---|---|---|---|")
        for model, faults, cpu, rate in ratios:
            print(f"| {model} | {faults:.2f} | {cpu:.2f} | {rate:.2f} |")


if __name__ == "__main__":
    main()
