"""Samples/s a PyTorch training loop receives from `tensorgate.data.ShardDataset` reading a warm
gateway cache, against a plain map-style `DataLoader` reading the same features from local `.npy`
files (one per sample), same workers, same batch size, one run; and each loader's memory (RSS of
the main process and its workers) after every epoch. Printed as markdown.

Run: .venv/bin/python bench/torch_loader.py     (after scripts/setup.sh and scripts/models.sh)
     TENSORGATE_BIN=... measures another build (default target/release/tensorgate)
     SHARDS=32 PER_SHARD=64 EPOCHS=5 WORKERS=2 BATCH=64 set the size

The gateway runs on its embedded fs backend; the first (unmeasured) pass fills its tensor cache, so
the measured epochs are what a second and later epoch costs: cache reads, HTTP, decoding, the
loader. The training step is a stand-in (one reduction per batch), so the loaders are the bound.
Pinned (bench/pinning.py): the gateway on the last core, the loaders (main process and workers) on
the others; the gateway's CPU per sample is reported for each row.
"""

import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from conftest import free_port, ort_library, wait_ready  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
import pinning  # noqa: E402

from tensorgate import Client  # noqa: E402
from tensorgate.data import ShardDataset  # noqa: E402

BINARY = Path(os.environ.get("TENSORGATE_BIN", ROOT / "target/release/tensorgate"))
SHARDS, PER_SHARD = int(os.environ.get("SHARDS", "32")), int(os.environ.get("PER_SHARD", "64"))
EPOCHS, WORKERS, BATCH = int(os.environ.get("EPOCHS", "5")), int(os.environ.get("WORKERS", "2")), int(os.environ.get("BATCH", "64"))
MODEL, SPLIT = "tiny-cnn", "block2"


def npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()


def shard(first: int, rng) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(first, first + PER_SHARD):
            for name, data in ((f"s{i:06d}.npy", npy(rng.random((3, 32, 32), dtype=np.float32))),
                               (f"s{i:06d}.cls", str(i % 10).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class LocalNpy(Dataset):
    """The baseline: one `.npy` of features per sample on local disk, and its label."""

    def __init__(self, files, labels):
        self.files, self.labels = files, labels

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return {"features": torch.from_numpy(np.load(self.files[i])), "label": torch.tensor(self.labels[i])}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def epochs(loader, gateway: int) -> tuple[list[float], list[float], float]:
    """Samples/s of each epoch, the RSS (main + workers, MiB) after it, and the gateway's CPU
    microseconds per sample over epochs 2+."""
    rates, mem, cpu, samples = [], [], 0.0, 0
    for epoch in range(EPOCHS):
        c0 = pinning.cpu_seconds(gateway)
        n, t = 0, time.perf_counter()
        for b in loader:
            b["features"].sum()  # the stand-in training step
            n += len(b["label"])
        rates.append(n / (time.perf_counter() - t))
        mem.append(rss_mib(os.getpid()) + sum(rss_mib(c) for c in children(os.getpid())))
        if epoch > 0:
            cpu, samples = cpu + pinning.cpu_seconds(gateway) - c0, samples + n
    return rates, mem, cpu / max(1, samples) * 1e6


def main():
    tmp = Path(tempfile.mkdtemp())
    port, admin_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
    env.update(TENSORGATE_LISTEN=f"127.0.0.1:{port}", TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin_port}",
               TENSORGATE_BACKEND_ROOT=str(tmp / "data"), TENSORGATE_MODELS_DIR=str(ROOT / "models"),
               TENSORGATE_ORT_LIBRARY=ort_library(), TENSORGATE_LOG="warn")
    proc = subprocess.Popen([str(BINARY), "serve"], env=env)
    try:
        admin = f"http://127.0.0.1:{admin_port}"
        wait_ready(admin, proc)
        pinning.pin_gateway(proc.pid)
        pinning.pin_rest()
        client = Client(f"http://127.0.0.1:{port}", "tensorgate-dev", "tensorgate-dev-secret", admin=admin)
        client.s3.create_bucket(Bucket="bench")
        rng = np.random.default_rng(0)
        keys = []
        for s in range(SHARDS):
            keys.append(f"train/{s:04d}.tar")
            client.s3.put_object(Bucket="bench", Key=keys[-1], Body=shard(s * PER_SHARD, rng))
        # Warm the gateway's cache, and write the same features as local files for the baseline.
        files, labels = [], []
        for key in keys:
            f = client.features("bench", key, MODEL, SPLIT)
            for k, x, y in zip(f.keys, f.features, f.labels):
                files.append(str(tmp / f"{k}.npy"))
                np.save(files[-1], x)
                labels.append(int(y))
        kw = dict(batch_size=BATCH, num_workers=WORKERS, multiprocessing_context="spawn", persistent_workers=True)
        gate = DataLoader(ShardDataset(client, "bench", MODEL, SPLIT, keys=keys), **kw)
        local = DataLoader(LocalNpy(files, labels), **kw)
        results = {}
        for name, loader in (("tensorgate ShardDataset (warm cache)", gate), ("local .npy files", local),
                             ("tensorgate ShardDataset (warm cache) again", gate), ("local .npy files again", local)):
            results[name] = epochs(loader, proc.pid)
        per = {n: statistics.median(r[1:]) for n, (r, _, _) in results.items()}  # epoch 1 starts the workers
        gate_rate = statistics.median([per["tensorgate ShardDataset (warm cache)"], per["tensorgate ShardDataset (warm cache) again"]])
        local_rate = statistics.median([per["local .npy files"], per["local .npy files again"]])
        print(f"## torch loader: {SHARDS} shards x {PER_SHARD} samples ({MODEL} {SPLIT} features, "
              f"{np.load(files[0]).nbytes} B each), batch {BATCH}, {WORKERS} spawned persistent workers, {EPOCHS} epochs, "
              f"{pinning.describe()}\n")
        print("| loader | samples/s per epoch | median (epochs 2+) | gateway CPU µs / sample | RSS after each epoch (MiB, main + workers) |")
        print("|---|---|---|---|---|")
        for name, (rates, mem, cpu) in results.items():
            print(f"| {name} | {' / '.join(f'{r:.0f}' for r in rates)} | {per[name]:.0f} | {cpu:.0f} | "
                  f"{' / '.join(f'{m:.0f}' for m in mem)} |")
        growth = {n: m[-1] - m[1] for n, (_, m, _) in results.items()}
        print(f"\nratio tensorgate / local files: {gate_rate / local_rate:.2f}; RSS change epoch 2 -> {EPOCHS}: "
              + ", ".join(f"{n} {g:+.0f} MiB" for n, g in growth.items()))
        print(json.dumps({"ratio": gate_rate / local_rate, "growth_mib": growth}))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
