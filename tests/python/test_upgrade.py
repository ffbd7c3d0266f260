"""Upgrades without dropping a request: under a bounded load of verifying clients with retries
off (PUT, GET, HEAD, multipart, DELETE and pushdowns, kept-alive connections), a new gateway
process takes the listening sockets over from the running one twice (`upgrade_socket`); every
answer must be right and none may fail."""

import hashlib
import io
import os
import signal
import subprocess
import threading
import time
import urllib.request

import boto3
import numpy as np
from botocore.config import Config
from PIL import Image

from conftest import BINARY, ROOT, free_port, ort_library, wait_ready
from test_pushdown import pushdown_get

# Each client stops after this many rounds or when told, whichever comes first.
MAX_ROUNDS = 400
SIZES = (64 * 1024, 256 * 1024, 1024 * 1024)


def start(tmp_path, name, env):
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen([str(BINARY), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT), log


def client(endpoint):
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="tensorgate-dev",
        aws_secret_access_key="tensorgate-dev-secret",
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1, "mode": "standard"}),
    )


def worker(endpoint, n, stop, failures, counts):
    s3 = client(endpoint)
    rng = np.random.default_rng(n)
    for i in range(MAX_ROUNDS):
        if stop.is_set():
            return
        key = f"w{n}/{i}"
        try:
            body = rng.bytes(SIZES[i % len(SIZES)])
            s3.put_object(Bucket="upgrade", Key=key, Body=body)
            got = s3.get_object(Bucket="upgrade", Key=key)["Body"].read()
            assert hashlib.sha256(got).digest() == hashlib.sha256(body).digest(), "GET returned other bytes"
            assert s3.head_object(Bucket="upgrade", Key=key)["ContentLength"] == len(body)
            part = s3.get_object(Bucket="upgrade", Key=key, Range="bytes=10-19")["Body"].read()
            assert part == body[10:20], "Range returned other bytes"
            if i % 10 == 0:
                up = s3.create_multipart_upload(Bucket="upgrade", Key=key + ".mp")["UploadId"]
                parts = [rng.bytes(5 * 1024 * 1024), rng.bytes(1000)]
                etags = [
                    s3.upload_part(Bucket="upgrade", Key=key + ".mp", UploadId=up, PartNumber=j + 1, Body=p)["ETag"]
                    for j, p in enumerate(parts)
                ]
                s3.complete_multipart_upload(
                    Bucket="upgrade", Key=key + ".mp", UploadId=up,
                    MultipartUpload={"Parts": [{"PartNumber": j + 1, "ETag": e} for j, e in enumerate(etags)]},
                )
                got = s3.get_object(Bucket="upgrade", Key=key + ".mp")["Body"].read()
                assert got == b"".join(parts), "multipart object differs"
                s3.delete_object(Bucket="upgrade", Key=key + ".mp")
            s3.delete_object(Bucket="upgrade", Key=key)
            counts[n] += 1
        except Exception as e:  # noqa: BLE001 - every failure is the test's finding
            failures.append(f"client {n} round {i}: {type(e).__name__}: {e}")
            return


def pushdowns(endpoint, n, stop, failures, counts, want):
    s3 = client(endpoint)
    for i in range(MAX_ROUNDS):
        if stop.is_set():
            return
        try:
            for split, expected in want.items():
                got = pushdown_get(s3, "upgrade", "img.png", model="tiny-cnn", split=split)["Body"].read()
                assert got == expected, f"pushdown {split} differs"
            counts[n] += 1
        except Exception as e:  # noqa: BLE001
            failures.append(f"pushdown client round {i}: {type(e).__name__}: {e}")
            return


def test_two_upgrades_under_load_fail_no_request(tmp_path, seaweed):
    port, admin_port = free_port(), free_port()
    endpoint, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORGATE_", "ORT_"))}
    env.update(
        TENSORGATE_LISTEN=f"127.0.0.1:{port}",
        TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin_port}",
        TENSORGATE_UPGRADE_SOCKET=str(tmp_path / "upgrade.sock"),
        TENSORGATE_MODELS_DIR=str(ROOT / "models"),
        TENSORGATE_ORT_LIBRARY=ort_library(),
        TENSORGATE_BACKEND_ENDPOINT=seaweed,
        TENSORGATE_BACKEND_ACCESS_KEY="seaweed-ak",
        TENSORGATE_BACKEND_SECRET_KEY="seaweed-sk",
        TENSORGATE_ACCESS_KEY="tensorgate-dev",
        TENSORGATE_SECRET_KEY="tensorgate-dev-secret",
        TENSORGATE_LOG="info",
    )
    procs = []
    try:
        first, log = start(tmp_path, "first", env)
        procs.append((first, log))
        wait_ready(admin, first)
        s3 = client(endpoint)
        s3.create_bucket(Bucket="upgrade")
        png = io.BytesIO()
        Image.new("RGB", (48, 40), (10, 120, 220)).save(png, format="PNG")
        s3.put_object(Bucket="upgrade", Key="img.png", Body=png.getvalue())
        want = {
            split: pushdown_get(s3, "upgrade", "img.png", model="tiny-cnn", split=split)["Body"].read()
            for split in ("block1", "pool")
        }

        stop, failures = threading.Event(), []
        counts = [0] * 9
        threads = [threading.Thread(target=worker, args=(endpoint, n, stop, failures, counts)) for n in range(8)]
        threads.append(threading.Thread(target=pushdowns, args=(endpoint, 8, stop, failures, counts, want)))
        for t in threads:
            t.start()
        previous = first
        for name in ("second", "third"):
            # Some load on the running process first.
            before = sum(counts)
            for _ in range(200):
                if sum(counts) >= before + 9 or failures:
                    break
                time.sleep(0.05)
            proc, log = start(tmp_path, name, env)
            procs.append((proc, log))
            # The old process hands over and drains; told to, it exits cleanly; the new one serves.
            old_log = tmp_path / f"{('first', 'second')[name == 'third']}.log"
            for _ in range(1200):
                if "Handed over to the new process" in old_log.read_text() or proc.poll() is not None:
                    break
                time.sleep(0.1)
            assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
            previous.send_signal(signal.SIGTERM)
            assert previous.wait(timeout=120) == 0, old_log.read_text()
            with urllib.request.urlopen(f"{admin}/readyz") as r:
                assert r.status == 200
            assert proc.poll() is None
            previous = proc
        before = sum(counts)
        for _ in range(200):
            if sum(counts) >= before + 9 or failures:
                break
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert not failures, failures
        assert all(c > 0 for c in counts), counts
        logs = "".join((tmp_path / f"{n}.log").read_text() for n in ("first", "second"))
        assert logs.count("Upgrade: the new process serves; handing over.") == 2, logs
        assert (tmp_path / "third.log").read_text().count("Took the listening sockets over") == 1
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
            log.close()
