"""Text encoders and Parquet datasets (ADRs 0016, 0017), one run, same machine, printed as markdown:

(a) text throughput: N_ROWS texts of 32-256 tokens (JSON Lines objects of 1,000 rows) pushed down
    through all-MiniLM-L6-v2 at `pool` by the gateway (release build, fs backend, one inference
    thread, the whole process pinned to one core) against the same ONNX Runtime prefix in Python
    (one intra-op thread, pinned to the same core) fed the same texts pre-tokenized, in batches
    of 32: the ratio is the gateway's tokenizing, parsing, batching and encoding overhead. Two
    baselines: every batch padded to the model's 128 tokens, and (what a careful user runs) each
    object's texts sorted by length and every batch padded to its longest text rounded up to 8,
    which is what the gateway does (ADR 0017); the gateway's padding share and mean batch size come
    from its /metrics;
(b) bytes moved per row at each split against the raw text (the JSON Lines row), and for images
    against the raw image column of a Hugging Face `datasets` Parquet file (ResNet-18,
    `format=parquet`, every other column kept).

Run: .venv/bin/python bench/text.py   (after scripts/setup.sh, scripts/models.sh and
     cargo build --release); N_ROWS=2000 for a shorter run.
"""

import io
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import boto3
import numpy as np
import onnxruntime as ort
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from conftest import free_port, ort_library, wait_ready  # noqa: E402
from test_pushdown import synthetic_photo  # noqa: E402

N_ROWS = int(os.environ.get("N_ROWS", "10000"))
PER_OBJECT = 1000
BATCH = 32
LAST = os.cpu_count() - 1
ALL_CPUS = os.sched_getaffinity(0)
BINARY = Path(os.environ.get("TENSORGATE_BIN", ROOT / "target/release/tensorgate"))
MINILM = ROOT / "models" / "minilm"
TEXT_SPLITS = ["embeddings", "layer4", "pool", "embedding"]
IMAGE_SPLITS = ["stem", "layer2", "layer3", "layer4", "pool"]
WORDS = ("the a model data storage network layer frozen feature vector gateway object bucket "
         "training epoch batch tensor split compute node cluster memory budget cache image text "
         "sentence encoder token transfer learning fine tune").split()


def texts(n: int, tokenizer: Tokenizer) -> list[str]:
    """Sentences of 32 to 256 tokens (uniform in tokens, as the tokenizer counts them)."""
    rng = np.random.default_rng(31)
    out = []
    for _ in range(n):
        target = int(rng.integers(32, 257))
        words = list(rng.choice(WORDS, size=target))
        while len(tokenizer.encode(" ".join(words)).ids) > target:
            words.pop()
        out.append(" ".join(words))
    return out


def metric(text: str, name: str, **labels) -> float:
    """The sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def gateway(tmp: Path):
    port, admin = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
    cfg = tmp / "gw.toml"
    cfg.write_text(f"[pushdown]\nintra_threads = 1\nworkers = 1\nmemory_budget = {4 << 30}\n")
    env.update(TENSORGATE_LISTEN=f"127.0.0.1:{port}", TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin}",
               TENSORGATE_BACKEND_ROOT=str(tmp / "data"), TENSORGATE_MODELS_DIR=str(ROOT / "models"),
               TENSORGATE_ORT_LIBRARY=ort_library(), TENSORGATE_LOG="warn", TENSORGATE_CONFIG=str(cfg))
    os.sched_setaffinity(0, ALL_CPUS - {LAST})
    proc = subprocess.Popen(["taskset", "-c", str(LAST), str(BINARY)], env=env)
    wait_ready(f"http://127.0.0.1:{admin}", proc)
    s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="tensorgate-dev",
                      aws_secret_access_key="tensorgate-dev-secret", region_name="us-east-1")
    return proc, s3, f"http://127.0.0.1:{admin}/metrics"


def get(s3, key: str, **fields) -> bytes:
    query = "".join(f"&tensorgate-{k}={v}" for k, v in fields.items())
    url = s3.generate_presigned_url("get_object", Params={"Bucket": "bench", "Key": key}, ExpiresIn=600) + query
    with urllib.request.urlopen(url) as r:
        return r.read()


def main():
    tokenizer = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    plain = Tokenizer.from_file(str(MINILM / "tokenizer.json"))
    plain.no_truncation()
    plain.no_padding()
    rows = texts(N_ROWS, plain)
    lengths = [len(plain.encode(t).ids) for t in rows[:1000]]
    objects = [
        "\n".join(json.dumps({"id": i, "text": t}) for i, t in enumerate(rows[o : o + PER_OBJECT], o)).encode()
        for o in range(0, N_ROWS, PER_OBJECT)
    ]
    tmp = Path(tempfile.mkdtemp())
    proc, s3, metrics_url = gateway(tmp)
    results = {}
    try:
        s3.create_bucket(Bucket="bench")
        for i, body in enumerate(objects):
            s3.put_object(Bucket="bench", Key=f"texts/{i:03d}.jsonl", Body=body)
        get(s3, "texts/000.jsonl", **{"model": "minilm", "split": "pool", "batch": "8"})  # warm-up
        t = time.perf_counter()
        for i in range(len(objects)):  # each a new object: no cache hits
            get(s3, f"texts/{i:03d}.jsonl", model="minilm", split="pool")
        results["gateway"] = N_ROWS / (time.perf_counter() - t)
        with urllib.request.urlopen(metrics_url) as r:
            m = r.read().decode()
        pool = {"model": "minilm", "split": "pool"}
        results["padding"] = metric(m, "tensorgate_pushdown_tokens_total", kind="padding", **pool) / (
            metric(m, "tensorgate_pushdown_tokens_total", **pool))
        results["mean batch"] = metric(m, "tensorgate_pushdown_batch_size_sum", **pool) / metric(
            m, "tensorgate_pushdown_batch_size_count", **pool)
        # (b) bytes per row, text: one object's output at each split.
        for split in TEXT_SPLITS:
            results[("text", split)] = len(get(s3, "texts/000.jsonl", model="minilm", split=split)) / PER_OBJECT
        # (b) images: a datasets-layout Parquet file of 64 photos (500 x 375 JPEGs) and a caption.
        photos = []
        for i in range(64):
            buf = io.BytesIO()
            synthetic_photo(500, 375, seed=3100 + i).save(buf, format="JPEG", quality=90)
            photos.append(buf.getvalue())
        image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        table = pa.table({"image": pa.array([{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(photos)], image_type),
                          "label": pa.array(range(64), pa.int64()),
                          "caption": pa.array([f"photo {i}" for i in range(64)])})
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=32)
        s3.put_object(Bucket="bench", Key="images.parquet", Body=buf.getvalue())
        results["image column"] = sum(map(len, photos)) / 64
        results["image file"] = len(buf.getvalue()) / 64
        for split in IMAGE_SPLITS:
            for dtype in ("f32", "f16"):
                out = get(s3, "images.parquet", model="resnet18", split=split, format="parquet", dtype=dtype)
                results[("image", split, dtype)] = len(out) / 64
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.sched_setaffinity(0, ALL_CPUS)

    # The baseline: the same prefix, one thread on the same core, fed pre-tokenized batches.
    os.sched_setaffinity(0, {LAST})
    import onnx

    model = onnx.load(MINILM / "model.onnx")
    model.graph.output.append(onnx.helper.make_tensor_value_info("pool", onnx.TensorProto.FLOAT, None))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), opts)
    enc = tokenizer.encode_batch(rows)
    ids = np.array([e.ids for e in enc], np.int64)
    mask = np.array([e.attention_mask for e in enc], np.int64)
    session.run(["pool"], {"input_ids": ids[:BATCH], "attention_mask": mask[:BATCH]})
    t = time.perf_counter()
    for b in range(0, N_ROWS, BATCH):
        session.run(["pool"], {"input_ids": ids[b : b + BATCH], "attention_mask": mask[b : b + BATCH]})
    results["ort"] = N_ROWS / (time.perf_counter() - t)
    # By length: per object, shortest first; each batch cut to its longest text rounded up to 8.
    lengths_all = mask.sum(axis=1)
    batches = []
    for o in range(0, N_ROWS, PER_OBJECT):
        order = o + np.argsort(lengths_all[o : o + PER_OBJECT], kind="stable")
        for b in range(0, len(order), BATCH):
            rows_b = order[b : b + BATCH]
            run = min(128, -(-int(lengths_all[rows_b].max()) // 8) * 8)
            batches.append((ids[rows_b, :run], mask[rows_b, :run]))
    t = time.perf_counter()
    for i, m in batches:
        session.run(["pool"], {"input_ids": i, "attention_mask": m})
    results["ort by length"] = N_ROWS / (time.perf_counter() - t)
    results["ort padding"] = 1 - float(lengths_all.sum()) / sum(i.size for i, _ in batches)
    os.sched_setaffinity(0, ALL_CPUS)

    print(f"{N_ROWS} texts of {min(lengths)}-{max(lengths)} tokens (first 1,000: mean {np.mean(lengths):.0f}), "
          f"padded and truncated to 128; all-MiniLM-L6-v2 at `pool`, one core\n")
    g, o, ol = results["gateway"], results["ort"], results["ort by length"]
    print("| | rows/s | padding share of the tokens run | gateway / this |")
    print("|---|---|---|---|")
    print(f"| gateway (mean batch {results['mean batch']:.1f}) | {g:.1f} | {results['padding']:.2f} | |")
    print(f"| ORT pre-tokenized, padded to 128 | {o:.1f} | {1 - float(lengths_all.sum()) / ids.size:.2f} | {g / o:.2f} |")
    print(f"| ORT pre-tokenized, by length | {ol:.1f} | {results['ort padding']:.2f} | {g / ol:.2f} |\n")
    raw = np.mean([len(l) + 1 for l in objects[0].split(b"\n")])
    print(f"Bytes per row, text (JSON Lines row: {raw:.0f} bytes), f32 safetensors of 1,000 rows\n")
    print("| split | bytes per row | raw / output |")
    print("|---|---|---|")
    for split in TEXT_SPLITS:
        b = results[("text", split)]
        print(f"| {split} | {b:,.0f} | {raw / b:.3f} |")
    col, whole = results["image column"], results["image file"]
    print(f"\nBytes per row, images (ResNet-18, `format=parquet`; the raw image column: {col:,.0f} bytes per row, "
          f"the whole source file {whole:,.0f})\n")
    print("| split | f32 bytes per row | column / f32 | f16 bytes per row | column / f16 |")
    print("|---|---|---|---|---|")
    for split in IMAGE_SPLITS:
        a, b = results[("image", split, "f32")], results[("image", split, "f16")]
        print(f"| {split} | {a:,.0f} | {col / a:.2f} | {b:,.0f} | {col / b:.2f} |")


if __name__ == "__main__":
    main()
