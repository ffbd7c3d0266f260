"""Fine-tune a classification head on frozen features streamed from tensorgate, with and without
pushdown, and print both accuracies (equal: the features are the same).

    python examples/finetune.py --endpoint http://127.0.0.1:9000 --admin http://127.0.0.1:9001 \\
        --bucket finetune --demo 640          # uploads 640 synthetic labeled JPEGs first
    python examples/finetune.py --model minilm --demo 640    # texts: Parquet files of sentences

Run it from a clone of the repository (the demo data come from its bench/dataset.py), with the
client's `examples` extra installed (`pip install "./clients/python[examples]"`; `torch` too for
--torch). The default model, pp-lcnet, and minilm come from scripts/models.sh; `--model tiny-cnn`
runs on the bundled test model alone (random weights: equal accuracies, but not meaningful ones).

With a text model (`minilm`) the data are Parquet files of labeled sentences (`text`, `label`); the
baseline tokenizes them here with the gateway's tokenizer and runs the encoder here.

The head is softmax regression on globally pooled freeze-split features, trained with numpy; with
--torch, the features come through a `torch.utils.data.DataLoader` (`--workers` spawned workers)
over `tensorgate.data.ShardDataset` and a torch linear layer is trained. The last shard is held out.

With --augment-epochs N the training set is N epochs of the recipe's `RandomResizedCrop` +
`RandomHorizontalFlip` (`tensorgate.Augment`, drawn anew each epoch from --seed), computed by the
gateway with pushdown and here without; the held-out shard is not augmented. Both ways see the
same draws, so the accuracies are equal again.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from tensorgate import Augment, Client, ShardLoader
from tensorgate.wds import SHARD_SUFFIXES


def demo_data(client: Client, bucket: str, prefix: str, n: int, per_shard: int, text: bool) -> None:
    """Synthetic labeled data (the repository's bench/dataset.py): ImageNet-like JPEGs in
    WebDataset shards, or for a text model sentences in Parquet files."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
    import dataset

    try:
        client.s3.create_bucket(Bucket=bucket)
    except client.s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    if text:
        shards, suffix = dataset.text_shards(dataset.sentences(n, classes=4), per_shard), "parquet"
    else:
        shards, suffix = dataset.image_shards(dataset.samples(n, classes=4), per_shard), "tar"
    for i, shard in enumerate(shards):
        client.s3.put_object(Bucket=bucket, Key=f"{prefix}{i:05d}.{suffix}", Body=shard)


def pooled(features: np.ndarray) -> np.ndarray:
    """Global average pooling of NCHW (or NHWC when the last axis is the smallest) features."""
    if features.ndim == 4:
        axes = (2, 3) if features.shape[1] >= features.shape[-1] else (1, 2)
        return features.mean(axis=axes)
    return features.reshape(len(features), -1)


def collect(loader: ShardLoader):
    xs, ys = [], []
    for f, labels, _ in loader:
        xs.append(pooled(f))
        ys.append(labels)
    return np.concatenate(xs), np.concatenate(ys)


def collect_torch(client, args, split, keys, augment=None, epoch=0):
    """Pooled features and labels through a multi-worker DataLoader, in key order."""
    import torch
    from torch.utils.data import DataLoader

    from tensorgate.data import ShardDataset

    ds = ShardDataset(client, args.bucket, args.model, split, keys=keys, augment=augment)
    ds.set_epoch(epoch)
    loader = DataLoader(ds, batch_size=args.batch_size, num_workers=args.workers,
                        multiprocessing_context="spawn" if args.workers else None)
    rows = []
    with torch.no_grad():
        for b in loader:
            rows += zip(b["key"], pooled(b["features"].numpy()), b["label"].numpy())
    rows.sort(key=lambda r: r[0])
    return np.stack([r[1] for r in rows]), np.array([r[2] for r in rows], dtype=np.int64)


def train_numpy(x, y, classes, epochs=200, lr=0.5, seed=0):
    rng = np.random.default_rng(seed)
    mu, sd = x.mean(0), x.std(0) + 1e-6
    x = (x - mu) / sd
    w = rng.normal(0, 0.01, (x.shape[1], classes))
    b = np.zeros(classes)
    onehot = np.eye(classes)[y]
    for _ in range(epochs):
        logits = x @ w + b
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        g = (p - onehot) / len(x)
        w -= lr * x.T @ g
        b -= lr * g.sum(0)
    return lambda z: (((z - mu) / sd) @ w + b).argmax(1)


def train_torch(x, y, classes, epochs=200, lr=0.5, seed=0):
    import torch

    torch.manual_seed(seed)
    mu, sd = x.mean(0), x.std(0) + 1e-6
    xt = torch.from_numpy((x - mu) / sd).float()
    head = torch.nn.Linear(x.shape[1], classes)
    opt = torch.optim.SGD(head.parameters(), lr=lr)
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(head(xt), torch.from_numpy(y)).backward()
        opt.step()
    return lambda z: head(torch.from_numpy((z - mu) / sd).float()).argmax(1).numpy()


def run(client, args, split):
    shards = client.list_keys(args.bucket, args.prefix, SHARD_SUFFIXES)
    train_keys, test_keys = shards[:-1], shards[-1:]  # the last shard is the test set
    t = time.perf_counter()
    chosen, sent = split, None
    augment = Augment(seed=args.seed) if args.augment_epochs else None
    epochs = range(max(1, args.augment_epochs))
    if args.torch:
        parts = [collect_torch(client, args, split, train_keys, augment, e) for e in epochs]
        xt, yt = collect_torch(client, args, split, test_keys)
    else:
        parts, sent = [], 0
        for e in epochs:  # one loader per epoch, each with its epoch's draws
            train = ShardLoader(client, args.bucket, args.prefix, args.model, split, args.batch_size, keys=train_keys,
                                augment=augment.for_epoch(e) if augment else None)
            parts.append(collect(train))
            sent += train.bytes_received
        test = ShardLoader(client, args.bucket, args.prefix, args.model, split, args.batch_size, keys=test_keys)
        xt, yt = collect(test)
        chosen = train.plans[-1]["plan"]["chosen"] if train.plans else split
        sent += test.bytes_received
    x, y = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
    fit = train_torch if args.torch else train_numpy
    predict = fit(x, y, int(max(y.max(), yt.max())) + 1)
    acc = float((predict(xt) == yt).mean())
    moved = f", {sent / 1e6:.1f} MB moved" if sent is not None else f", {args.workers} loader workers"
    print(f"{'no pushdown' if split == 'none' else 'pushdown'} (split {chosen}): accuracy {acc:.4f} "
          f"on {len(yt)} held-out samples{moved}, {time.perf_counter() - t:.1f} s")
    return acc, x


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", default="http://127.0.0.1:9000")
    ap.add_argument("--admin", default="http://127.0.0.1:9001")
    ap.add_argument("--access-key", default="tensorgate-dev")
    ap.add_argument("--secret-key", default="tensorgate-dev-secret")
    ap.add_argument("--bucket", default="finetune")
    ap.add_argument("--prefix", default="train/")
    ap.add_argument("--model", default="pp-lcnet")
    ap.add_argument("--split", default=None, help="split to push down (default: the model's freeze split; 'auto' plans)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--demo", type=int, default=0, help="first upload this many synthetic labeled JPEGs")
    ap.add_argument("--per-shard", type=int, default=64)
    ap.add_argument("--torch", action="store_true",
                    help="read through a multi-worker torch DataLoader and train a torch linear head")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers with --torch (spawned)")
    ap.add_argument("--augment-epochs", type=int, default=0,
                    help="train on this many epochs of RandomResizedCrop + RandomHorizontalFlip (images)")
    ap.add_argument("--seed", type=int, default=0, help="the augmentation's seed")
    args = ap.parse_args(argv)
    client = Client(args.endpoint, args.access_key, args.secret_key, admin=args.admin)
    models = client.models()
    if args.model not in models:
        ap.error(f"the gateway has no model {args.model!r} (it has: {', '.join(sorted(models))}); "
                 "scripts/models.sh adds the trained ones")
    info = models[args.model]
    if args.demo:
        demo_data(client, args.bucket, args.prefix, args.demo, args.per_shard, bool(info.get("text")))
    split = args.split or info["freeze"]
    with_pd, x1 = run(client, args, split)
    without, x2 = run(client, args, "none")
    # Equal to float rounding: where the gateway cuts a batch's padding (texts at a pooled split),
    # sums run in another order than in the baseline's run at the model's length.
    err = float(np.linalg.norm(x1 - x2) / max(np.linalg.norm(x2), 1e-30)) if x1.shape == x2.shape else float("inf")
    print(f"features relative L2 difference: {err:.1e}; accuracies {'equal' if with_pd == without else 'DIFFER'}")
    return 0 if with_pd == without and err <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
