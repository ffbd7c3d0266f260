"""The compute-tier side of one reproduction run: stream a dataset through tensorgate in one mode
and train a softmax-regression head on the freeze-split features, for some epochs; print one
JSON line with the epoch times, the bytes received and the split used.

Modes (HAPI's names): `images` (baseline images: raw JPEG shards, decoded and run through every
frozen layer here), `tensors` (baseline tensors: pre-transformed input shards, every frozen layer
here), `split:NAME` (pushdown at a fixed split), `auto` (the planner chooses). A `+local` suffix
keeps finished features on the compute tier across epochs (`ShardLoader(local_cache_bytes=...)`,
revalidated each epoch with If-None-Match). A `+augment` suffix trains with torchvision's
`RandomResizedCrop` + `RandomHorizontalFlip`, seeded, drawn anew each epoch (ADR 0032).
`--dtype f16` asks for half-precision features (and plans for them)."""

import argparse
import json
import os
import sys
import time

import numpy as np

from tensorgate import Augment, Client, ShardLoader
from tensorgate.suffix import prefetch_graphs


#: The augmented runs' seed: every mode draws the same boxes and flips per epoch.
AUGMENT_SEED = 51


class Head:
    """Softmax regression on globally pooled features, one SGD step per batch."""

    def __init__(self, classes: int, lr: float = 0.05, seed: int = 0):
        self.classes, self.lr, self.rng = classes, lr, np.random.default_rng(seed)
        self.w = None

    def step(self, features: np.ndarray, labels: np.ndarray) -> None:
        x = features.mean(axis=(2, 3)) if features.ndim == 4 and features.shape[1] >= features.shape[-1] else (
            features.mean(axis=(1, 2)) if features.ndim == 4 else features.reshape(len(features), -1))
        if self.w is None:
            self.w = self.rng.normal(0, 0.01, (x.shape[1], self.classes))
        logits = x @ self.w
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(labels)), labels] -= 1
        self.w -= self.lr * x.T @ p / len(x)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--admin", required=True)
    ap.add_argument("--access-key", required=True)
    ap.add_argument("--secret-key", required=True)
    ap.add_argument("--bucket", default="repro")
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--overlap", type=int, default=1)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--dtype", default=None, help="features' element type on the wire (f16, bf16; default f32)")
    ap.add_argument("--train-secs", type=float, default=0.0,
                    help="extra seconds per batch, emulating the trainable layers on an accelerator (no CPU)")
    args = ap.parse_args(argv)
    client = Client(args.endpoint, args.access_key, args.secret_key, admin=args.admin)
    # `+augment`: the recipe's RandomResizedCrop + RandomHorizontalFlip, drawn anew each epoch
    # (ADR 0032) by the gateway, or here over the raw JPEGs (`images`, `split=none`).
    augment = Augment(seed=AUGMENT_SEED) if args.mode.endswith("+augment") else None
    mode = args.mode.removesuffix("+augment")
    mode, local = (mode[: -len("+local")], 1 << 30) if mode.endswith("+local") else (mode, 0)
    if mode == "images":
        prefix, split = "images/", "none"
    elif mode == "tensors":
        prefix, split = f"tensors/{args.model}/", "none"
    elif mode.startswith("split:"):
        prefix, split = "images/", mode.split(":", 1)[1]
    else:
        prefix, split = "images/", "auto"
    # Setup, not epoch time: the compute tier holds its model's layers (HAPI's client has them).
    prefetch_graphs(client, args.model)
    head = Head(args.classes)
    epochs, moved, chosen = [], 0, split
    batches, timeline = [], {}
    loader = None
    for epoch in range(args.epochs):
        t = time.perf_counter()
        if loader is None:  # one loader: an auto plan is made once, in the first epoch
            loader = ShardLoader(client, args.bucket, prefix, args.model, split, args.batch_size,
                                 prefetch=4 if args.overlap else 1, overlap=bool(args.overlap),
                                 local_cache_bytes=local, dtype=args.dtype,
                                 # SUFFIX_RUNS=N: shards running their suffix at once (the
                                 # comparison with the loader's suffixes unordered).
                                 suffix_runs=int(os.environ.get("SUFFIX_RUNS", "0")))
        loader.augment = augment.for_epoch(epoch) if augment else None
        before, first = loader.bytes_received, not epochs
        waited = t
        for features, labels, _ in loader:
            got = time.perf_counter()
            head.step(features, labels)
            if args.train_secs:
                time.sleep(args.train_secs)
            if first:
                batches.append({"waited": round(got - waited, 4), "head": round(time.perf_counter() - got, 4)})
            waited = time.perf_counter()
        epochs.append(time.perf_counter() - t)
        if first:  # where the first epoch's time went (seconds from the epoch's start)
            timeline = {"events": [[kind, index, round(at - t, 4)] for kind, index, at in loader.events],
                        "bodies": [[f.split, f.bytes, round(f.body_started - t, 4), round(f.body_ended - t, 4)]
                                   for f in loader.fetches]}
        moved += loader.bytes_received - before
        if loader.plans:
            chosen = loader.plans[-1]["plan"]["chosen"]
            loader.requested_split = chosen  # later epochs keep the plan (no re-profiling)
            loader.split = chosen
    plans = [{"chosen": p["plan"]["chosen"], "bandwidth": p["profile"]["bandwidth_bytes_per_sec"],
              "predicted": {c["split"]: c["epoch_secs"] for c in p["plan"]["candidates"]},
              # the cost model's terms, to re-evaluate the choice offline (`tensorgate plan`)
              "candidates": p["plan"]["candidates"], "profile": p["profile"], "storage": p.get("storage")}
             for p in (loader.plans if loader else [])]
    used = sorted(loader.splits_used) if loader else []
    json.dump({"epochs": epochs, "bytes": moved, "split": chosen, "splits_used": used, "plans": plans,
               "profile_secs": loader.profile_seconds if loader else 0.0, "timeline": timeline,
               "batches": batches}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
