"""Does the gateway finish a client's concurrent requests in the order they arrived? (ADR 0019)

Four WebDataset shards of 64 synthetic JPEGs are asked for at once (threads started GAP seconds
apart, default 2 ms), REPS times; prints when each request's response headers arrived (seconds
from the first request). In order means shard i's answer before shard i+1's. Pinned: SeaweedFS and
the gateway (release build, one inference worker, cache off) on CPU 0, this client on the caller's
CPUs (run it under `taskset -c 1`). The gateway's CPU seconds over the run are printed last.
Each repetition asks twice, once with `seq` (the client's order, as the loader sends it; ADR 0021)
and once without (the gateway numbers requests as it gets to them), alternating.

Run: taskset -c 1 .venv/bin/python bench/arrival_order.py [SPLIT]   (default layer3; ResNet-18)
     ... layer4,layer2                       shard 0 at the first split, the others at the second
                                             (the Python loader's first shard, sent before its plan)
     RUNS=N ...                              `pushdown.inference_runs` (default 0: one per core)
     TENSORGATE_BIN=path/to/tensorgate ...   another build (default target/release/tensorgate)
     COLD=1 ...                              no warm-up request (the engine starts under the load)
     REPS=6 GAP=0.03 ...                     repetitions, and the gap between the threads' starts
     GATEWAY_LOG=tensorgate::pushdown=debug  the gateway's log level (its log: the run's temporary directory)
"""

import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import boto3
import onnxruntime

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import dataset  # noqa: E402

from tensorgate import Client  # noqa: E402

PORT = 18744
LISTEN, ADMIN = "127.0.0.1:19801", "127.0.0.1:19802"
SHARDS, PER_SHARD = 4, 64


def main() -> None:
    splits = (sys.argv[1] if len(sys.argv) > 1 else "layer3").split(",")
    split = ",".join(splits)
    at = [splits[0]] + [splits[-1]] * (SHARDS - 1)  # shard i's split
    reps, gap = int(os.environ.get("REPS", "3")), float(os.environ.get("GAP", "0.002"))
    env = dict(os.environ, SEAWEED_PORT=str(PORT))
    store = subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "start"], env=env, capture_output=True, text=True,
                           check=True).stdout.strip()
    pid = (ROOT / f".tmp/seaweedfs-{PORT}/pid").read_text().strip()
    subprocess.run(["taskset", "-a", "-pc", "0", pid], capture_output=True, check=False)
    work = Path(tempfile.mkdtemp(prefix="arrival-order-"))
    cfg = work / "gateway.toml"
    cfg.write_text('[[credentials]]\naccess_key = "bench"\nsecret_key = "bench-secret"\n'
                   "[pushdown]\nworkers = 1\nmax_batch = 16\nqueue_capacity = 1024\n"
                   f"inference_runs = {int(os.environ.get('RUNS', '0'))}\n[pushdown.cache]\nenabled = false\n")
    lib = next((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so*"))
    binary = os.environ.get("TENSORGATE_BIN") or str(ROOT / "target/release/tensorgate")
    genv = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
    genv.update(TENSORGATE_CONFIG=str(cfg), TENSORGATE_LISTEN=LISTEN, TENSORGATE_ADMIN_LISTEN=ADMIN,
                TENSORGATE_BACKEND_ENDPOINT=store, TENSORGATE_BACKEND_ACCESS_KEY="seaweed-ak",
                TENSORGATE_BACKEND_SECRET_KEY="seaweed-sk", TENSORGATE_MODELS_DIR=str(ROOT / "models"),
                TENSORGATE_ORT_LIBRARY=str(lib), TENSORGATE_LOG=os.environ.get("GATEWAY_LOG", "warn"))
    gw = subprocess.Popen(["taskset", "-c", "0", binary, "serve"], env=genv,
                          stdout=open(work / "gateway.log", "w"), stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://{ADMIN}/readyz", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        s3 = boto3.client("s3", endpoint_url=store, aws_access_key_id="seaweed-ak",
                          aws_secret_access_key="seaweed-sk", region_name="us-east-1")
        s3.create_bucket(Bucket="order")
        for i, shard in enumerate(dataset.image_shards(dataset.samples(SHARDS * PER_SHARD), PER_SHARD)):
            s3.put_object(Bucket="order", Key=f"s{i}.tar", Body=shard)
        c = Client(f"http://{LISTEN}", "bench", "bench-secret", admin=f"http://{ADMIN}")
        if not os.environ.get("COLD"):
            for warm in dict.fromkeys(splits):  # the engines started and warm
                c.get("order", "s0.tar", "resnet18", warm, dtype="f16")
        in_order = {"seq": 0, "no seq": 0}
        for _, mode in ((r, m) for r in range(reps) for m in in_order):
            t0, done, stream = time.perf_counter(), {}, secrets.token_hex(8)

            def one(i, t0=t0, done=done, stream=stream, mode=mode):
                c.get("order", f"s{i}.tar", "resnet18", at[i], dtype="f16",
                      seq=f"{stream}.{i}" if mode == "seq" else None,
                      before_body=lambda: done.__setitem__(i, round(time.perf_counter() - t0, 2)))

            threads = [threading.Thread(target=one, args=(i,)) for i in range(SHARDS)]
            for t in threads:
                t.start()
                time.sleep(gap)
            for t in threads:
                t.join(timeout=600)
            got = [done.get(i) for i in range(SHARDS)]
            in_order[mode] += got == sorted(got)
            print(f"{split}, {mode}: headers at {got}", flush=True)
        for mode, n in in_order.items():
            print(f"in order, {mode}: {n} of {reps}")
        stat = (Path("/proc") / str(gw.pid) / "stat").read_text().split(")")[1].split()
        print(f"gateway CPU s: {(int(stat[11]) + int(stat[12])) / os.sysconf('SC_CLK_TCK'):.2f}")
    finally:
        gw.terminate()
        gw.wait(timeout=30)
        subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "stop"], env=env, capture_output=True, check=False)


if __name__ == "__main__":
    main()
