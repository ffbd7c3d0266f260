"""What `glibc.malloc.hugetlb=1` (ADR 0012) does, in three measurements:

(a) whether glibc applies it: a 64 MiB `malloc`, touched, in a child Python started with and
    without the tunable beside the 128 KiB threshold: `AnonHugePages` of the child
    (`/proc/self/smaps_rollup`), and the `GLIBC_TUNABLES` its environment still shows;
(b) where the gateway uses huge pages: its `AnonHugePages`, sampled every 5 ms, during three
    64 MiB PUT + GET and one multipart upload (passthrough, fs backend), then during one pushdown
    of 12 samples (ResNet-50-thin `stage1`);
(c) whether the memory model changes: `/v1/memory` of a ResNet-18 `layer1` engine after one shard
    of four samples, the gateway started with `GLIBC_TUNABLES` set to the threshold alone and to
    the threshold with huge pages (the binary's default).

    TENSORGATE_BIN=target/release/tensorgate .venv/bin/python bench/huge_pages.py

Uses the test suite's gateway launcher (tests/python/conftest.py)."""

import ctypes
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "python"))

import boto3.s3.transfer  # noqa: E402
import numpy as np  # noqa: E402
import urllib3  # noqa: E402
from conftest import run_gateway  # noqa: E402
from test_memory import NO_CACHE, features_of, npy_shard, presigned, sigv4  # noqa: E402

THRESHOLD = "glibc.malloc.mmap_threshold=131072"
HUGE = THRESHOLD + ":glibc.malloc.hugetlb=1"


def huge_kib(pid: int | str = "self") -> int:
    return int(re.search(r"AnonHugePages:\s+(\d+)", Path(f"/proc/{pid}/smaps_rollup").read_text()).group(1))


def child() -> None:
    """(a), in the child: one touched 64 MiB block."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    block = libc.malloc(64 << 20)
    ctypes.memset(block, 1, 64 << 20)
    shown = [e for e in Path("/proc/self/environ").read_bytes().split(b"\0") if e.startswith(b"GLIBC_TUNABLES=")]
    print(f"{huge_kib()} kB AnonHugePages; environment shows {shown[0].decode() if shown else 'nothing'}")


def peak_huge_during(pid: int, work) -> int:
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], huge_kib(pid))
            time.sleep(0.005)
    t = threading.Thread(target=watch)
    t.start()
    try:
        work()
    finally:
        done.set()
        t.join()
    return peak[0]


def main() -> None:
    print("(a) a touched 64 MiB malloc")
    for tunables in (THRESHOLD, HUGE):
        out = subprocess.run([sys.executable, __file__, "child"], env={**os.environ, "GLIBC_TUNABLES": tunables},
                             capture_output=True, text=True, check=True).stdout.strip()
        print(f"  GLIBC_TUNABLES={tunables}: {out}")

    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        print("\n(b) the gateway's peak AnonHugePages (default tunables)")
        (Path(tmp) / "b").mkdir()
        with run_gateway(Path(tmp) / "b", NO_CACHE) as (_, _, s3, pid):
            body = os.urandom(64 << 20)
            s3.create_bucket(Bucket="huge")

            def passthrough():
                for i in range(3):
                    s3.put_object(Bucket="huge", Key=f"o{i}", Body=body)
                    assert s3.get_object(Bucket="huge", Key=f"o{i}")["Body"].read() == body
                s3.upload_fileobj(io.BytesIO(body), "huge", "multipart",
                                  Config=boto3.s3.transfer.TransferConfig(multipart_threshold=8 << 20))
            print(f"  passthrough, 64 MiB PUT + GET x3 and a multipart upload: {peak_huge_during(pid, passthrough)} kB")
            shard = npy_shard([rng.random((224, 224, 3), dtype=np.float32) for _ in range(12)])
            s3.put_object(Bucket="huge", Key="p.tar", Body=shard)
            url = presigned(sigv4(s3), "huge", "p.tar")
            kib = peak_huge_during(pid, lambda: features_of(urllib3.PoolManager(), url, "resnet50-thin", "stage1"))
            print(f"  pushdown, ResNet-50-thin stage1, 12 samples: {kib} kB")

        print("\n(c) the memory model of ResNet-18 layer1 (MB)")
        shard = npy_shard([rng.random((3, 224, 224), dtype=np.float32) for _ in range(4)])
        for n, tunables in enumerate((THRESHOLD, HUGE)):
            (Path(tmp) / f"c{n}").mkdir()
            with run_gateway(Path(tmp) / f"c{n}", NO_CACHE, env={"GLIBC_TUNABLES": tunables}) as (_, admin, s3, _):
                s3.put_object(Bucket="demo", Key="m.tar", Body=shard)
                features_of(urllib3.PoolManager(), presigned(sigv4(s3), "demo", "m.tar"), "resnet18", "layer1")
                with urllib.request.urlopen(f"{admin}/v1/memory") as resp:
                    engine = json.load(resp)["engines"][0]
                m = engine["memory"]
                print(f"  {tunables}: probe peaks {m['probe_peaks'][0] / 1e6:.2f} / {m['probe_peaks'][1] / 1e6:.2f}, "
                      f"session {m['session_bytes'] / 1e6:.1f}, engine reserved {engine['reserved_bytes'] / 2**20:.0f} MiB")


if __name__ == "__main__":
    child() if sys.argv[1:] == ["child"] else main()
