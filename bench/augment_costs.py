"""Where an augmented sample's time goes (ADR 0032, item 6): what a cache of source bytes or of
decoded images could save across augmented epochs, which draw anew and so recompute the prefix.

The release gateway (one inference worker, the tensor cache off, pinned to the last core) in front
of a SeaweedFS on the first core; 64 synthetic 500 x 375 JPEGs (~110 kB). Per model at `pool`,
each image is requested once with `RandomResizedCrop` + `RandomHorizontalFlip` (a seed per round),
one request at a time so the stages are not shared. Per request: its time at the client, and the
gateway's `server-timing` `fetch` (the store's read of the source: what a cache of encoded bytes
saves). The JPEG decode (what a cache of decoded images saves besides) is timed alone on the
gateway's core with Pillow, whose decoder is the same libjpeg-turbo.

Run: .venv/bin/python bench/augment_costs.py    (after scripts/setup.sh, scripts/models.sh and
     cargo build --release; MODELS=pp-lcnet,resnet18,resnet50-thin and ROUNDS=3 by default)
"""

import io
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
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "clients" / "python"))
from pushdown import jpegs  # noqa: E402

from tensorgate import Augment  # noqa: E402

PORT = 18764
LISTEN, ADMIN = "127.0.0.1:19811", "127.0.0.1:19812"
N = 64
MODELS = os.environ.get("MODELS", "pp-lcnet,resnet18,resnet50-thin").split(",")
ROUNDS = int(os.environ.get("ROUNDS", "3"))
LAST = os.cpu_count() - 1


def timing(header: str) -> dict[str, float]:
    """`server-timing` as {name: ms}."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur)
    return out


def decode_ms(images: list[bytes]) -> float:
    """Median ms of Pillow's decode to RGB, on this (pinned) core."""
    from PIL import Image

    times = []
    for j in images:
        t = time.perf_counter()
        Image.open(io.BytesIO(j)).convert("RGB").load()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main() -> None:
    import onnxruntime

    env = dict(os.environ, SEAWEED_PORT=str(PORT))
    store = subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "start"], env=env, capture_output=True, text=True,
                           check=True).stdout.strip()
    pid = (ROOT / f".tmp/seaweedfs-{PORT}/pid").read_text().strip()
    subprocess.run(["taskset", "-a", "-pc", "0", pid], capture_output=True, check=False)
    work = Path(tempfile.mkdtemp(prefix="augment-costs-"))
    cfg = work / "gateway.toml"
    cfg.write_text('[[credentials]]\naccess_key = "bench"\nsecret_key = "bench-secret"\n'
                   "[pushdown]\nworkers = 1\n[pushdown.cache]\nenabled = false\n")
    lib = next((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so*"))
    binary = os.environ.get("TENSORGATE_BIN") or str(ROOT / "target/release/tensorgate")
    genv = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
    genv.update(TENSORGATE_CONFIG=str(cfg), TENSORGATE_LISTEN=LISTEN, TENSORGATE_ADMIN_LISTEN=ADMIN,
                TENSORGATE_BACKEND_ENDPOINT=store, TENSORGATE_BACKEND_ACCESS_KEY="seaweed-ak",
                TENSORGATE_BACKEND_SECRET_KEY="seaweed-sk", TENSORGATE_MODELS_DIR=str(ROOT / "models"),
                TENSORGATE_ORT_LIBRARY=str(lib), TENSORGATE_LOG="warn")
    gw = subprocess.Popen(["taskset", "-c", str(LAST), binary, "serve"], env=genv,
                          stdout=open(work / "gateway.log", "w"), stderr=subprocess.STDOUT)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://{ADMIN}/readyz", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        direct = boto3.client("s3", endpoint_url=store, aws_access_key_id="seaweed-ak",
                              aws_secret_access_key="seaweed-sk", region_name="us-east-1")
        direct.create_bucket(Bucket="augcost")
        images = jpegs(N)
        for i, j in enumerate(images):
            direct.put_object(Bucket="augcost", Key=f"{i}.jpg", Body=j)
        s3 = boto3.client("s3", endpoint_url=f"http://{LISTEN}", aws_access_key_id="bench",
                          aws_secret_access_key="bench-secret", region_name="us-east-1")
        os.sched_setaffinity(0, {LAST})
        dec = statistics.median(decode_ms(images) for _ in range(ROUNDS))
        os.sched_setaffinity(0, set(range(os.cpu_count())) - {LAST})
        print(f"{N} JPEGs of {statistics.mean(map(len, images)) / 1e3:.0f} kB; Pillow decode alone on the "
              f"gateway's core: {dec:.2f} ms per image (median of {ROUNDS} passes)\n")
        print("| model at pool | request ms | fetch ms (store read) | decode ms | fetch share | fetch + decode share |")
        print("|---|---|---|---|---|---|")
        for model in MODELS:
            req, fetch = [], []
            for r in range(ROUNDS + 1):  # round 0 warms the engine up
                aug = Augment(seed=r)
                for i in range(N):
                    url = s3.generate_presigned_url("get_object", Params={"Bucket": "augcost", "Key": f"{i}.jpg"},
                                                    ExpiresIn=3600)
                    q = "&".join(f"tensorgate-{k}={urllib.request.quote(v, safe='')}"
                                 for k, v in {"model": model, "split": "pool", **aug.fields()}.items())
                    t = time.perf_counter()
                    with urllib.request.urlopen(f"{url}&{q}") as resp:
                        resp.read()
                        st = timing(resp.headers["server-timing"])
                    if r:
                        req.append((time.perf_counter() - t) * 1e3)
                        fetch.append(st["fetch"])
            rq, fe = statistics.median(req), statistics.median(fetch)
            print(f"| {model} | {rq:.2f} | {fe:.2f} | {dec:.2f} | {fe / rq:.3f} | {(fe + dec) / rq:.3f} |", flush=True)
    finally:
        gw.terminate()
        gw.wait(timeout=30)
        subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "stop"], env=env, capture_output=True, check=False)


if __name__ == "__main__":
    main()
