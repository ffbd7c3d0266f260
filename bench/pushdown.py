"""Pushdown benchmarks, one run, same machine, printed as markdown:

(a) data reduction: bytes per sample at every split of each model vs the JPEG and the decoded
    input tensor (HAPI's table);
(b) images/s: pushdown through the gateway (release build, fs backend, 1 and 2 inference threads
    across concurrent requests) vs a Python pipeline doing the same work (PIL decode + resize +
    numpy normalisation + onnxruntime on the same prefix) with 1 and 2 worker threads;
(c) the ceiling: onnxruntime alone on pre-decoded batches of the same prefix;
(d) the floor: on one core, in isolation, the best JPEG decode (Pillow's libjpeg-turbo,
    SIMD), the resize + normalise, and onnxruntime at its best batch size; the floor is
    1 / (decode + preprocess + inference) per image, and the one-thread gateway is measured against
    it.

Pinned (PIN=1, the default, on 2+ cores): with one inference thread the gateway runs alone on the
last core and the client, the Python pipeline and the floor on that same last core too when they
run (one at a time), so every one-thread number is one core's; with two threads nothing is pinned.

Run: .venv/bin/python bench/pushdown.py   (after scripts/setup.sh and scripts/models.sh)
     TENSORGATE_BIN=path/to/tensorgate ...  measures another build (default target/release/tensorgate)
     BENCH_MODELS=pp-lcnet ...              measures a subset of the models
     ORT_ARENA=off ...                      the gateway with `pushdown.ort_arena = "off"`
     ORT_ARENA=kept (or 1) ...              the gateway with `pushdown.ort_arena = "kept"`
     (unset: the default, "per-run")
     RUNS=N ...                             the gateway with `pushdown.inference_runs = N`
"""

import concurrent.futures as cf
import io
import os
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from pathlib import Path

import boto3
import numpy as np
import onnxruntime as ort
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from conftest import free_port, ort_library, wait_ready  # noqa: E402
import dataset  # noqa: E402
from test_pushdown import reference_preprocess, synthetic_photo  # noqa: E402

N_IMAGES = int(os.environ.get("N_IMAGES", "48"))
LAST = os.cpu_count() - 1
PIN = os.environ.get("PIN", "1") == "1" and LAST >= 1
ALL_CPUS = os.sched_getaffinity(0)
BINARY = Path(os.environ.get("TENSORGATE_BIN", ROOT / "target/release/tensorgate"))
MODELS = {"resnet18": ["layer3", "pool"], "resnet50-thin": ["stage1", "pool"], "pp-lcnet": ["block2", "pool"]}
# BENCH_MODELS=pp-lcnet,resnet18 measures a subset.
MODELS = {m: s for m, s in MODELS.items() if m in os.environ.get("BENCH_MODELS", ",".join(MODELS)).split(",")}

# ORT_ARENA: a `pushdown.ort_arena` other than the default.
ARENA_LINE = {"1": 'ort_arena = "kept"\n', "kept": 'ort_arena = "kept"\n', "off": 'ort_arena = "off"\n',
              "per-run": 'ort_arena = "per-run"\n'}


def manifest(model):
    return tomllib.loads((ROOT / "models" / model / "manifest.toml").read_text())


def jpegs(n=N_IMAGES, first_seed=1000):
    """`n` synthetic 500x375 photos as JPEGs (quality 92), seeded from `first_seed` on."""
    out = []
    for i in range(n):
        buf = io.BytesIO()
        synthetic_photo(500, 375, seed=first_seed + i).save(buf, format="JPEG", quality=92)
        out.append(buf.getvalue())
    return out


def jpeg_shard(n):
    """`jpegs(n)` with their labels as one WebDataset tar (`sNNN.jpg`, `sNNN.cls`)."""
    return dataset.tar_of((f"s{i:03d}{ext}", data) for i, jpeg in enumerate(jpegs(n))
                          for ext, data in ((".jpg", jpeg), (".cls", b"1")))


def prefix_session(model, split, threads):
    """The same prefix the gateway runs (cut by `tensorgate models cut`), in Python onnxruntime."""
    m = manifest(model)
    tensor = next(s["tensor"] for s in m["splits"] if s["name"] == split)
    out = Path(tempfile.mkdtemp()) / "prefix.onnx"
    subprocess.run([str(BINARY), "models", "cut", str(ROOT / "models" / model / "model.onnx"), "--split", tensor, "--out", str(out)], check=True, capture_output=True)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(out), opts, providers=["CPUExecutionProvider"]), m["input"], tensor


def per_item(fn, items) -> float:
    """Median over three passes of the seconds `fn` takes per item."""
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for it in items:
            fn(it)
        times.append((time.perf_counter() - t) / len(items))
    return float(np.median(times))


def best_inference(model, split, xs) -> tuple[float, int]:
    """(seconds per image, batch size) of onnxruntime on the prefix at its best batch size on
    this core: the median of three timed runs per size, inputs cycled from `xs`."""
    sess, name, tensor = prefix_session(model, split, 1)
    best = (float("inf"), 1)
    for b in (1, 2, 4, 8, 16, 32):
        x = np.ascontiguousarray(xs[np.arange(b) % len(xs)])
        sess.run([tensor], {name: x})
        runs = []
        for _ in range(3):
            t = time.perf_counter()
            sess.run([tensor], {name: x})
            runs.append((time.perf_counter() - t) / b)
        best = min(best, (float(np.median(runs)), b))
    return best


def floor(model, split, images):
    """(images/s, (decode s, preprocess s, inference s, best batch)) on one core: each stage alone,
    the median of three passes over the images (decode, preprocess) or of three timed runs per
    batch size (inference, the best batch size per image)."""
    os.sched_setaffinity(0, {LAST} if PIN else ALL_CPUS)
    try:
        def decoded(j):
            im = Image.open(io.BytesIO(j))
            im.load()
            return im

        loaded = [decoded(j) for j in images]
        dec = per_item(decoded, images)
        it = iter(range(10**9))
        pre = per_item(lambda _j: reference_preprocess(loaded[next(it) % len(loaded)], model), images)
        xs = np.stack([reference_preprocess(im, model) for im in loaded[:32]]).astype(np.float32)
        best = best_inference(model, split, xs)
        return 1 / (dec + pre + best[0]), (dec, pre, best[0], best[1])
    finally:
        os.sched_setaffinity(0, ALL_CPUS)


def main():
    images = jpegs()
    jpeg_mean = np.mean([len(j) for j in images])
    tmp = Path(tempfile.mkdtemp())
    port, admin = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
    results = {}
    print(f"{N_IMAGES} synthetic 500x375 JPEGs, mean {jpeg_mean / 1e3:.1f} kB\n")
    for threads in (1, 2):
        env.update(
            TENSORGATE_LISTEN=f"127.0.0.1:{port}",
            TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin}",
            TENSORGATE_BACKEND_ROOT=str(tmp / f"data{threads}"),
            TENSORGATE_MODELS_DIR=str(ROOT / "models"),
            TENSORGATE_ORT_LIBRARY=ort_library(),
            TENSORGATE_LOG="warn",
        )
        cfg = tmp / f"gw{threads}.toml"
        # A 4 GiB budget: the six engines of one run fit with batches of 16 in both settings (with
        # the arena on they do not fit the 1 GiB default: ADR 0011), so the budget is no variable.
        cfg.write_text(f"[pushdown]\nintra_threads = 1\nworkers = {threads}\nmemory_budget = {4 << 30}\n"
                       + ARENA_LINE.get(os.environ.get("ORT_ARENA"), "")
                       + (f"inference_runs = {int(os.environ['RUNS'])}\n" if os.environ.get("RUNS") else ""))
        env["TENSORGATE_CONFIG"] = str(cfg)
        pin = ["taskset", "-c", str(LAST)] if PIN and threads == 1 else []
        # The client on the other cores while the one-thread gateway has the last one to itself.
        os.sched_setaffinity(0, ALL_CPUS - {LAST} if pin else ALL_CPUS)
        proc = subprocess.Popen(pin + [str(BINARY)], env=env)
        try:
            wait_ready(f"http://127.0.0.1:{admin}", proc)
            s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="tensorgate-dev",
                              aws_secret_access_key="tensorgate-dev-secret", region_name="us-east-1")
            s3.create_bucket(Bucket="bench")
            for i, j in enumerate(images):
                s3.put_object(Bucket="bench", Key=f"{i}.jpg", Body=j)
            for model, splits in MODELS.items():
                for split in splits:
                    # URLs are presigned before timing, so the client's own CPU use stays small
                    # (it shares the machine's 2 cores with the gateway).
                    urls = [
                        s3.generate_presigned_url("get_object", Params={"Bucket": "bench", "Key": f"{i}.jpg"}, ExpiresIn=600)
                        + f"&tensorgate-model={model}&tensorgate-split={split}"
                        for i in range(N_IMAGES)
                    ]

                    def get(i, urls=urls):
                        with urllib.request.urlopen(urls[i]) as r:
                            return len(r.read())
                    get(0)  # warm-up: builds and checks the prefix
                    t = time.perf_counter()
                    with cf.ThreadPoolExecutor(4) as ex:
                        sizes = list(ex.map(get, range(N_IMAGES)))
                    results[("gateway", model, split, threads)] = N_IMAGES / (time.perf_counter() - t)
                    results[("bytes", model, split)] = np.mean(sizes)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            os.sched_setaffinity(0, ALL_CPUS)

    for model, splits in MODELS.items():
        for split in splits:
            results[("floor", model, split)], results[("floor-parts", model, split)] = floor(model, split, images)
            for threads in (1, 2):
                os.sched_setaffinity(0, {LAST} if PIN and threads == 1 else ALL_CPUS)
                sess, name, tensor = prefix_session(model, split, 1)
                sessions = [prefix_session(model, split, 1)[0] for _ in range(threads)]

                def python_pipeline(i, model=model):
                    x = reference_preprocess(Image.open(io.BytesIO(images[i])), model)[None].astype(np.float32)
                    return sessions[i % threads].run([tensor], {name: x})[0]

                python_pipeline(0)
                t = time.perf_counter()
                with cf.ThreadPoolExecutor(threads) as ex:
                    list(ex.map(python_pipeline, range(N_IMAGES)))
                results[("python", model, split, threads)] = N_IMAGES / (time.perf_counter() - t)
                # Ceiling: bare onnxruntime on pre-decoded batches of 8, same thread count.
                xs = np.stack([reference_preprocess(Image.open(io.BytesIO(images[i])), model) for i in range(16)]).astype(np.float32)
                ceil_sess = prefix_session(model, split, threads)[0]
                ceil_sess.run([tensor], {name: xs[:8]})
                t = time.perf_counter()
                runs = max(1, N_IMAGES // 8)
                for r in range(runs):
                    ceil_sess.run([tensor], {name: xs[(r % 2) * 8 : (r % 2) * 8 + 8]})
                results[("ceiling", model, split, threads)] = runs * 8 / (time.perf_counter() - t)
            os.sched_setaffinity(0, ALL_CPUS)

    print("(a) bytes per sample (f32 output) vs the JPEG and the decoded input tensor\n")
    print("| model | split | output bytes | JPEG / output | decoded tensor / output |")
    print("|---|---|---|---|---|")
    for model, splits in MODELS.items():
        decoded = 4 * int(np.prod(manifest(model)["input_shape"]))
        for split in splits:
            b = results[("bytes", model, split)]
            print(f"| {model} | {split} | {b:,.0f} | {jpeg_mean / b:.2f} | {decoded / b:.2f} |")
    print("\n(b, c) images/s\n")
    print("| model | split | threads | gateway | Python pipeline | gateway / Python | ORT ceiling | gateway / ceiling |")
    print("|---|---|---|---|---|---|---|---|")
    for model, splits in MODELS.items():
        for split in splits:
            for threads in (1, 2):
                g, p, c = (results[(k, model, split, threads)] for k in ("gateway", "python", "ceiling"))
                print(f"| {model} | {split} | {threads} | {g:.1f} | {p:.1f} | {g / p:.2f} | {c:.1f} | {g / c:.2f} |")
    print(f"\n(d) the floor on one core ({'pinned to CPU ' + str(LAST) if PIN else 'unpinned'}): ms per image\n")
    print("| model | split | decode | resize + normalise | inference (best batch) | floor img/s | gateway 1 thread | gateway / floor | gateway 2 threads / 1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, splits in MODELS.items():
        for split in splits:
            d, pre, inf, b = results[("floor-parts", model, split)]
            f, g1, g2 = results[("floor", model, split)], results[("gateway", model, split, 1)], results[("gateway", model, split, 2)]
            print(f"| {model} | {split} | {d * 1e3:.2f} | {pre * 1e3:.2f} | {inf * 1e3:.2f} (batch {b}) | {f:.1f} | {g1:.1f} "
                  f"| {g1 / f:.2f} | {g2 / g1:.2f} |")


if __name__ == "__main__":
    main()
