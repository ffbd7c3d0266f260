"""A reader's first reads of a Parquet output (ADR 0030) or a WebDataset shard's output (ADR 0031,
`SOURCE=shard`) nobody computed yet, one run, same machine, printed as markdown.

`datasets`-layout files of each size in SIZES (photos of 500 x 375 JPEG, a label and a caption,
row groups of GROUP rows) read as pyarrow reads a file with its defaults, through each gateway
build named in BINS (release builds, fs backend, one inference thread, the gateway pinned to one
core), ResNet-18 at `pool`, `format=parquet`:

- `HEAD`: the first request of all (the file's size);
- footer: then pyarrow's first read, the file's last 64 KiB;
- first byte: then a `GET` of the whole file, until its first byte;
- whole file: until its last byte; rows per second over all three requests, and the output's
  bytes per row.

With `SOURCE=shard`: a tar shard of the same photos (`{i}.jpg` and `{i}.cls`), `format=tar`; no
footer read (the `HEAD`, then the `GET`).

Each size is a new object for each build (no cache hit). A build that computes the output before
it answers pays the computation at the `HEAD`; one that answers from the outline (or a shard's
layout) pays it as the bytes are read. Run:
  BINS="before=<old tensorgate>,after=target/release/tensorgate" .venv/bin/python bench/first_read.py
"""

import io
import os
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import text as textbench  # noqa: E402  (its gateway())
from row_groups import dataset, photos  # noqa: E402
from test_pushdown import tar_of  # noqa: E402

SIZES = [int(n) for n in os.environ.get("SIZES", "200,1000").split(",")]
GROUP = int(os.environ.get("GROUP", "100"))
SHARD = os.environ.get("SOURCE", "parquet") == "shard"
FIELDS = {"model": "resnet18", "split": "pool", "format": "tar" if SHARD else "parquet"}
SUFFIX = "tar" if SHARD else "parquet"
TAIL = 64 * 1024  # pyarrow's footer_read_size


def source(rows: int) -> bytes:
    """The object read: a Parquet file of `rows` photos, or a shard of them."""
    if not SHARD:
        return dataset(rows, GROUP)
    return tar_of([(f"{i}.{ext}", data) for i, p in enumerate(photos(rows))
                   for ext, data in (("jpg", p), ("cls", str(i % 10).encode()))])


def url(s3, key: str, op: str = "get_object") -> str:
    query = "".join(f"&tensorgate-{k}={v}" for k, v in FIELDS.items())
    return s3.generate_presigned_url(op, Params={"Bucket": "bench", "Key": key}, ExpiresIn=600) + query


def timed(request: urllib.request.Request, first_byte: bool = False) -> tuple[float, float, bytes]:
    """Seconds to the response's first byte, to its last, and the body."""
    t = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as r:
        head = r.read(1)
        first = time.perf_counter() - t
        body = head + r.read()
    return first, time.perf_counter() - t, body


def measure(name: str, binary: Path, files: dict[int, bytes]) -> list[dict]:
    textbench.BINARY = binary
    proc, s3, _ = textbench.gateway(Path(tempfile.mkdtemp()))
    out = []
    try:
        s3.create_bucket(Bucket="bench")
        s3.put_object(Bucket="bench", Key=f"warm.{SUFFIX}", Body=files[min(files)])
        timed(urllib.request.Request(url(s3, f"warm.{SUFFIX}")))  # starts the engine
        for rows, data in files.items():
            key = f"{rows}.{SUFFIX}"
            s3.put_object(Bucket="bench", Key=key, Body=data)
            t = time.perf_counter()
            with urllib.request.urlopen(urllib.request.Request(url(s3, key, "head_object"), method="HEAD"), timeout=600) as r:
                size = int(r.headers["Content-Length"])
            head = time.perf_counter() - t
            footer = 0.0
            if not SHARD:
                _, footer, _ = timed(urllib.request.Request(url(s3, key), headers={"Range": f"bytes=-{TAIL}"}))
            first, whole, body = timed(urllib.request.Request(url(s3, key)))
            assert len(body) == size
            if SHARD:
                with tarfile.open(fileobj=io.BytesIO(body)) as t:
                    assert len(t.getnames()) == 2 * rows
            else:
                assert pq.read_metadata(io.BytesIO(body)).num_rows == rows
            out.append({"build": name, "rows": rows, "head": head, "footer": footer, "first": first,
                        "whole": whole, "rate": rows / (head + footer + whole), "per_row": size / rows})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        os.sched_setaffinity(0, textbench.ALL_CPUS)
    return out


def main():
    bins = [b.split("=", 1) for b in os.environ.get("BINS", f"after={ROOT / 'target/release/tensorgate'}").split(",")]
    files = {rows: source(rows) for rows in SIZES}
    results = []
    for name, path in bins:
        results += measure(name, Path(path), files)
    layout = "a tar shard" if SHARD else f"row groups of {GROUP}"
    print(f"Photos (500 x 375 JPEG) in {layout}; ResNet-18 at `pool`, `format={FIELDS['format']}`, one core, "
          "fs backend; seconds\n")
    print("| build | rows | HEAD | footer (last 64 KiB) | GET first byte | GET last byte | rows/s, all three | "
          "output bytes per row |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['build']} | {r['rows']} | {r['head']:.3f} | {r['footer']:.3f} | {r['first']:.3f} | "
              f"{r['whole']:.2f} | {r['rate']:.1f} | {r['per_row']:.0f} |")


if __name__ == "__main__":
    main()
