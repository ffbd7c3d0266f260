"""Parquet files by row group (ADR 0018), one run, same machine, printed as markdown.

A Hugging Face `datasets`-layout Parquet file of N_ROWS photos (500 x 375 JPEGs, a label and a
caption; row groups of GROUP rows) pushed down through ResNet-18 at `pool` by each gateway build
named in BINS (release builds, fs backend, one inference thread, the gateway pinned to one core):

- the whole file in one request, and (where the build has `row-groups`) the same file one row
  group per request, in sequence;
- rows per second, and the request's peak memory hold: the highest
  `tensorgate_pushdown_memory_reserved_bytes` sampled every few milliseconds during the
  request(s), less what the engines held before (their fixed reservation).

Each measurement reads a new copy of the file (no cache hit). Run:
  BINS="before=.tmp/tensorgate-before,after=target/release/tensorgate" .venv/bin/python bench/row_groups.py
  FORMAT=parquet ...   a Parquet output (the other columns kept) instead of the default safetensors
"""

import io
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import text as textbench  # noqa: E402  (its gateway(), get() and metric())
from test_pushdown import synthetic_photo  # noqa: E402

N_ROWS = int(os.environ.get("N_ROWS", "192"))
GROUP = int(os.environ.get("GROUP", "32"))
ROUNDS = int(os.environ.get("ROUNDS", "2"))
RESERVED = "tensorgate_pushdown_memory_reserved_bytes"


def photos(rows: int) -> list[bytes]:
    """`rows` synthetic photos, 500 x 375 JPEGs."""
    out = []
    for i in range(rows):
        buf = io.BytesIO()
        synthetic_photo(500, 375, seed=4100 + i).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def dataset(rows: int = N_ROWS, group: int = GROUP) -> bytes:
    """A `datasets`-layout file of `rows` photos, a label and a caption, `group` rows to a group."""
    photos_ = photos(rows)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"image": pa.array([{"bytes": b, "path": f"{i}.jpg"} for i, b in enumerate(photos_)], image_type),
                      "label": pa.array([i % 10 for i in range(rows)], pa.int64()),
                      "caption": pa.array([f"photo {i}" for i in range(rows)])})
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=group)
    return buf.getvalue()


class Peak:
    """The highest value of the reserved-bytes gauge while it runs (sampled every 5 ms)."""

    def __init__(self, url: str):
        self.url, self.peak, self.stop = url, 0.0, threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)

    def sample(self):
        while not self.stop.is_set():
            with urllib.request.urlopen(self.url) as r:
                self.peak = max(self.peak, textbench.metric(r.read().decode(), RESERVED))
            time.sleep(0.005)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def measure(name: str, binary: Path, data: bytes) -> list[dict]:
    textbench.BINARY = binary
    tmp = Path(tempfile.mkdtemp())
    proc, s3, metrics_url = textbench.gateway(tmp)
    out = []
    try:
        s3.create_bucket(Bucket="bench")
        groups = pq.ParquetFile(io.BytesIO(data)).metadata.num_row_groups
        fields = {"model": "resnet18", "split": "pool"}
        if os.environ.get("FORMAT"):
            fields["format"] = os.environ["FORMAT"]
        s3.put_object(Bucket="bench", Key="warm.parquet", Body=data)
        textbench.get(s3, "warm.parquet", **fields)  # starts the engine
        modes = [("whole file", [None])]
        if name != "before":
            modes.append(("by row group", [str(g) for g in range(groups)]))
        for r in range(ROUNDS):
            for mode, parts in modes:
                key = f"{mode.replace(' ', '-')}-{r}.parquet"
                s3.put_object(Bucket="bench", Key=key, Body=data)
                with urllib.request.urlopen(metrics_url) as resp:
                    idle = textbench.metric(resp.read().decode(), RESERVED)
                with Peak(metrics_url) as peak:
                    t = time.perf_counter()
                    for g in parts:
                        textbench.get(s3, key, **fields, **({"row-groups": g} if g else {}))
                    secs = time.perf_counter() - t
                out.append({"build": name, "mode": mode, "round": r, "rows_per_sec": N_ROWS / secs,
                            "peak_hold": peak.peak - idle})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.sched_setaffinity(0, textbench.ALL_CPUS)
    return out


def main():
    bins = [b.split("=", 1) for b in os.environ.get("BINS", f"after={ROOT / 'target/release/tensorgate'}").split(",")]
    data = dataset()
    rows = []
    for name, path in bins:
        rows += measure(name, Path(path), data)
    print(f"{N_ROWS} photos (500 x 375 JPEG, {len(data) / 2**20:.1f} MiB file) in row groups of {GROUP}; "
          "ResNet-18 at `pool`, one core, fs backend\n")
    print("| build | request | round | rows/s | peak hold (MiB) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['build']} | {r['mode']} | {r['round']} | {r['rows_per_sec']:.1f} | {r['peak_hold'] / 2**20:.1f} |")
    best = {}
    for r in rows:
        k = (r["build"], r["mode"])
        best[k] = (max(best.get(k, (0, 0))[0], r["rows_per_sec"]), max(best.get(k, (0, 0))[1], r["peak_hold"]))
    base = best.get(("before", "whole file"))
    if base:
        print("\n| build, request | rows/s vs before (whole file) | peak hold vs before |")
        print("|---|---|---|")
        for (b, m), (rate, hold) in best.items():
            print(f"| {b}, {m} | {rate / base[0]:.2f} | {hold / base[1]:.2f} |")


if __name__ == "__main__":
    main()
