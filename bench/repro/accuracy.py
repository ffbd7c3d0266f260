"""Does half precision on the wire cost the head accuracy? (f16 outputs where the
head's accuracy stays within 0.1 point of f32.)

One gateway and SeaweedFS on loopback (no shaping: only the features matter here). A labeled
synthetic dataset (bench/dataset.py) is split into training and held-out shards; for each dtype the
features at the model's freeze split are fetched once through `ShardLoader(dtype=...)`, then the
reproduction's softmax-regression head (bench/repro/trainer.py) is trained on them for a number of
epochs in one fixed order with one seed, so that the dtype is the only difference. Reported per
dtype: held-out accuracy, its difference from f32, how often its predictions equal f32's, the
features' relative L2 error against f32, and bytes received.

    .venv/bin/python bench/repro/accuracy.py                      # ResNet-50-thin at pool, ~4 minutes
    .venv/bin/python bench/repro/accuracy.py --classes 30 --epochs 60

Appends one JSON line per dtype to bench/results/repro-accuracy.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run  # noqa: E402  (puts bench/ and the client on the path)
from trainer import Head  # noqa: E402

import dataset  # noqa: E402
from tensorgate import Client, ShardLoader  # noqa: E402

DTYPES = ("f32", "f16", "bf16")


def features(client: Client, model: str, keys: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray, int]:
    loader = ShardLoader(client, "repro", "", model, run.manifest(model)["freeze"], 64, keys=keys,
                         dtype=None if dtype == "f32" else dtype)
    feats, labels = zip(*((f, l) for f, l, _ in loader))
    return np.concatenate(feats), np.concatenate(labels), loader.bytes_received


def pooled(x: np.ndarray) -> np.ndarray:
    """What the head sees (as `Head.step` pools it)."""
    return x.mean(axis=(2, 3)) if x.ndim == 4 else x.reshape(len(x), -1)


def train(x: np.ndarray, y: np.ndarray, classes: int, epochs: int, batch: int) -> Head:
    head = Head(classes)
    order = np.random.default_rng(1).permutation(len(x))  # one fixed order for every dtype
    for _ in range(epochs):
        for i in range(0, len(x), batch):
            idx = order[i : i + batch]
            head.step(x[idx], y[idx])
    return head


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="resnet50-thin")
    ap.add_argument("--train", type=int, default=1024, help="training images")
    ap.add_argument("--held-out", type=int, default=512, help="held-out images")
    ap.add_argument("--classes", type=int, default=10,
                    help="labels of the synthetic data (30 or 100: closer palettes, a weaker head)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", type=Path, default=run.ROOT / "bench" / "results" / "repro-accuracy.jsonl")
    args = ap.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="repro-accuracy-"))
    items = dataset.samples(args.train + args.held_out, classes=args.classes, seed=7)
    shards = list(dataset.image_shards(items, 64))
    objects = {f"{i:05d}.tar": s for i, s in enumerate(shards)}
    keys = sorted(objects)
    split_at = args.train // 64
    train_keys, held_keys = keys[:split_at], keys[split_at:]
    tiers = run.Tiers(False, workdir, cache=False)
    rows = []
    try:
        tiers.start()
        tiers.upload(objects)
        client = Client(tiers.endpoint, run.KEY, run.SECRET, admin=tiers.admin)
        got = {}
        for dtype in DTYPES:
            t = time.perf_counter()
            xtr, ytr, moved = features(client, args.model, train_keys, dtype)
            xho, yho, moved_ho = features(client, args.model, held_keys, dtype)
            got[dtype] = (xtr, ytr, xho, yho, moved + moved_ho, time.perf_counter() - t)
        ref = got["f32"]
        ref_pred = None
        for dtype in DTYPES:
            xtr, ytr, xho, yho, moved, secs = got[dtype]
            assert np.array_equal(ytr, ref[1]) and np.array_equal(yho, ref[3]), "labels must not depend on dtype"
            head = train(xtr, ytr, args.classes, args.epochs, args.batch)
            pred = (pooled(xho) @ head.w).argmax(1)
            ref_pred = pred if dtype == "f32" else ref_pred
            err = float(np.linalg.norm(xho - ref[2]) / np.linalg.norm(ref[2]))
            rows.append(dict(model=args.model, split=run.manifest(args.model)["freeze"], dtype=dtype,
                             classes=args.classes, train=len(ytr), held_out=len(yho), epochs=args.epochs,
                             accuracy=float((pred == yho).mean()), agreement_with_f32=float((pred == ref_pred).mean()),
                             rel_l2_vs_f32=err, bytes_received=moved, fetch_secs=secs))
    finally:
        tiers.stop()
    acc32 = rows[0]["accuracy"]
    with args.out.open("a") as f:
        for r in rows:
            r["accuracy_minus_f32_points"] = 100 * (r["accuracy"] - acc32)
            f.write(json.dumps(r) + "\n")
    print("| dtype | held-out accuracy | minus f32 (points) | same prediction as f32 | features rel. L2 vs f32 | MB received |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {100 * r['accuracy']:.2f}% | {r['accuracy_minus_f32_points']:+.2f} | "
              f"{100 * r['agreement_with_f32']:.1f}% | {r['rel_l2_vs_f32']:.2e} | {r['bytes_received'] / 1e6:.2f} |")


if __name__ == "__main__":
    main()
