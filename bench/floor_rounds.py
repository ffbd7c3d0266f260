"""The gateway against the one-core floor, in alternating rounds.

`bench/pushdown.py` measures the floor once, minutes after the gateway, over one pass of 48
images (0.3-0.5 s for PP-LCNet): on this shared machine the floor itself moved 132-210 img/s
between such runs, so its single ratios spread 0.64-0.93 and decided nothing. Here, per
(model, split), each round runs one timed pass through the gateway and then the floor on the
same core, and the ratio is taken within the round; the report gives every round's ratio and
their median.

The gateway runs with its defaults: no configuration file at all (so no pushdown key is set;
`pushdown.ort_arena` is its default, per run), started with its whole process pinned to the last
core, which makes every default that follows the cores (inference runs, preprocessing threads)
one core's. Each round reads its own copies of the images (keys `r<round>/<i>.jpg`), so no pass
is served from the gateway's cache, which stays on as by default. The client (4 threads,
presigned URLs) runs on the other cores; the floor (`bench/pushdown.py`'s: Pillow decode,
resize + normalise, onnxruntime at its best batch size, each stage alone) on the last core.

Run: .venv/bin/python bench/floor_rounds.py          (after scripts/setup.sh and scripts/models.sh)
     ROUNDS=5 N_IMAGES=240 ...                       rounds and images per pass (defaults)
     FLOOR_MODELS=pp-lcnet:pool,resnet18:pool ...    the (model, split) pairs
     TENSORGATE_BIN=path/to/tensorgate ...           another build (default target/release/tensorgate)
     GATEWAY_TOML='[pushdown.cache]\nenabled = false' ...   a configuration file instead of none
"""

import concurrent.futures as cf
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import boto3

from pushdown import ALL_CPUS, BINARY, LAST, PIN, floor, jpegs
from conftest import free_port, ort_library, wait_ready

ROUNDS = int(os.environ.get("ROUNDS", "5"))
N_IMAGES = int(os.environ.get("N_IMAGES", "240"))
PAIRS = [tuple(p.split(":")) for p in
         os.environ.get("FLOOR_MODELS", "resnet18:pool,resnet50-thin:pool,pp-lcnet:pool").split(",")]
CLIENT_THREADS = 4


def main():
    if not PIN:
        raise SystemExit("needs 2+ cores: the gateway and the floor on the last one, the client on the others")
    images = jpegs(N_IMAGES)
    tmp = Path(tempfile.mkdtemp())
    port, admin = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
    env.update(
        TENSORGATE_LISTEN=f"127.0.0.1:{port}",
        TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin}",
        TENSORGATE_BACKEND_ROOT=str(tmp / "data"),
        TENSORGATE_MODELS_DIR=str(Path(__file__).resolve().parents[1] / "models"),
        TENSORGATE_ORT_LIBRARY=ort_library(),
        TENSORGATE_LOG="warn",
    )
    if os.environ.get("GATEWAY_TOML"):
        (tmp / "gateway.toml").write_text(os.environ["GATEWAY_TOML"].replace("\\n", "\n") + "\n")
        env["TENSORGATE_CONFIG"] = str(tmp / "gateway.toml")
    os.sched_setaffinity(0, ALL_CPUS - {LAST})
    proc = subprocess.Popen(["taskset", "-c", str(LAST), str(BINARY)], env=env)
    rows = []
    try:
        wait_ready(f"http://127.0.0.1:{admin}", proc)
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="tensorgate-dev",
                          aws_secret_access_key="tensorgate-dev-secret", region_name="us-east-1")
        s3.create_bucket(Bucket="bench")
        # One copy of the images per round, and one for the warm-up.
        for r in range(ROUNDS + 1):
            for i, j in enumerate(images):
                s3.put_object(Bucket="bench", Key=f"r{r}/{i}.jpg", Body=j)
        for model, split in PAIRS:
            def urls(r):
                return [s3.generate_presigned_url("get_object", Params={"Bucket": "bench", "Key": f"r{r}/{i}.jpg"},
                                                  ExpiresIn=3600)
                        + f"&tensorgate-model={model}&tensorgate-split={split}" for i in range(N_IMAGES)]

            def get(url):
                with urllib.request.urlopen(url) as resp:
                    return len(resp.read())

            # Warm-up: starts the engine (its probes) and the connections.
            with cf.ThreadPoolExecutor(CLIENT_THREADS) as ex:
                list(ex.map(get, urls(ROUNDS)[:16]))
            for r in range(ROUNDS):
                batch = urls(r)
                os.sched_setaffinity(0, ALL_CPUS - {LAST})
                t = time.perf_counter()
                with cf.ThreadPoolExecutor(CLIENT_THREADS) as ex:
                    list(ex.map(get, batch))
                gateway = N_IMAGES / (time.perf_counter() - t)
                fl, (dec, pre, inf, best) = floor(model, split, images)
                rows.append((model, split, r, gateway, fl, dec, pre, inf, best))
                print(f"{model} {split} round {r + 1}: gateway {gateway:.1f} img/s, floor {fl:.1f}, "
                      f"ratio {gateway / fl:.2f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.sched_setaffinity(0, ALL_CPUS)

    print(f"\n{N_IMAGES} synthetic 500x375 JPEGs per pass, {ROUNDS} rounds, gateway defaults, one core\n")
    print("| model | split | gateway img/s (median) | floor img/s (median) | gateway / floor per round | median |")
    print("|---|---|---|---|---|---|")
    for model, split in PAIRS:
        mine = [x for x in rows if x[0] == model and x[1] == split]
        ratios = [x[3] / x[4] for x in mine]
        print(f"| {model} | {split} | {statistics.median(x[3] for x in mine):.1f} "
              f"| {statistics.median(x[4] for x in mine):.1f} | {', '.join(f'{v:.2f}' for v in ratios)} "
              f"| {statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
