"""The gateway of a storage node never stops serving (issue 48): under a constant bounded load of
eight verifying clients with retries off (PUT and GET of 64 KiB to 8 MiB with HEAD, Range, multipart
and DELETE; pushdowns on two models), for at least TENSORGATE_NO_DOWNTIME_SECS (60 s), the test adds
a model, removes one, rotates a key by SIGHUP, revokes one through the admin API, reloads a bad file
and then a good one, and upgrades the binary twice (one client reads through an alias endpoint,
whose socket each upgrade hands over too). Every answer is checked against what it must
be; none may fail. The revoked and rotated keys are refused from their next request (on kept-alive
connections, and by the upgraded processes); the removed model's engines leave `/v1/memory`. On the
store the tests run against (TENSORGATE_TEST_STORE: SeaweedFS, Ceph RGW, Swift)."""

import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.request
import uuid

import numpy as np
import pytest
from botocore.exceptions import ClientError
from PIL import Image

from conftest import BINARY, ROOT, STORE_KIND, free_port, metric, ort_library, wait_ready
from test_models_runtime import add_model, listing, until
from test_pushdown import pushdown_get
from test_reload import admin_reload, client, credentials, hang_up, proof, refused

pytestmark = pytest.mark.skipif(STORE_KIND == "fs", reason="a store behind the gateway")

LOAD_SECONDS = float(os.environ.get("TENSORGATE_NO_DOWNTIME_SECS", "60"))
# Each client also stops after this many rounds, and at the latest this long after the start.
MAX_ROUNDS, MAX_SECONDS = 2000, LOAD_SECONDS + 600
SIZES = (64 * 1024, 512 * 1024, 2 * 1024 * 1024, 8 * 1024 * 1024)
LOAD, ALICE_OLD, ALICE_NEW, CAROL = "load-secret", "alice-secret-one", "alice-secret-two", "carol-secret"
# Pushdowns on two models: (model, split) pairs each pushdown client checks.
PUSHDOWNS = ({"tiny-cnn": ("block1", "pool")}, {"tiny-vit": ("block0", "pooled")})


def objects(endpoint, bucket, n, stop, failures, counts, deadline):
    s3 = client(endpoint, "load", LOAD)
    rng = np.random.default_rng(n)
    for i in range(MAX_ROUNDS):
        if stop.is_set() or time.monotonic() > deadline:
            return
        key = f"w{n}/{i}"
        try:
            body = rng.bytes(SIZES[(i + n) % len(SIZES)])
            s3.put_object(Bucket=bucket, Key=key, Body=body)
            got = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
            assert hashlib.sha256(got).digest() == hashlib.sha256(body).digest(), "GET returned other bytes"
            assert s3.head_object(Bucket=bucket, Key=key)["ContentLength"] == len(body)
            part = s3.get_object(Bucket=bucket, Key=key, Range="bytes=10-19")["Body"].read()
            assert part == body[10:20], "Range returned other bytes"
            if i % 8 == n % 8:
                up = s3.create_multipart_upload(Bucket=bucket, Key=key + ".mp")["UploadId"]
                parts = [rng.bytes(5 * 1024 * 1024), rng.bytes(1000)]
                etags = [s3.upload_part(Bucket=bucket, Key=key + ".mp", UploadId=up, PartNumber=j + 1, Body=p)["ETag"]
                         for j, p in enumerate(parts)]
                s3.complete_multipart_upload(
                    Bucket=bucket, Key=key + ".mp", UploadId=up,
                    MultipartUpload={"Parts": [{"PartNumber": j + 1, "ETag": e} for j, e in enumerate(etags)]})
                assert s3.get_object(Bucket=bucket, Key=key + ".mp")["Body"].read() == b"".join(parts), "multipart"
                s3.delete_object(Bucket=bucket, Key=key + ".mp")
            s3.delete_object(Bucket=bucket, Key=key)
            counts[n] += 1
        except Exception as e:  # noqa: BLE001 - every failure is the test's finding
            failures.append(f"client {n} round {i}: {type(e).__name__}: {e}")
            return


def pushdowns(endpoint, bucket, n, stop, failures, counts, deadline, want, alias=None):
    """Pushdowns with fields; with `alias` (an endpoint URL and the bytes it must answer), a read
    through that alias endpoint too."""
    s3 = client(endpoint, "load", LOAD)
    through = client(alias[0], "load", LOAD) if alias else None
    for i in range(MAX_ROUNDS):
        if stop.is_set() or time.monotonic() > deadline:
            return
        try:
            for (model, split), expected in want.items():
                got = pushdown_get(s3, bucket, "img.png", model=model, split=split)["Body"].read()
                assert got == expected, f"pushdown {model} {split} differs"
            if through:
                assert through.get_object(Bucket=bucket, Key="img.png")["Body"].read() == alias[1], "alias endpoint"
            counts[n] += 1
        except Exception as e:  # noqa: BLE001
            failures.append(f"pushdown client {n} round {i}: {type(e).__name__}: {e}")
            return


class Node:
    """The gateway as its successive processes: each upgrade starts a new one that takes the
    listening sockets over."""

    def __init__(self, tmp_path, env):
        self.tmp, self.env, self.procs = tmp_path, env, []
        self.admin = f"http://127.0.0.1:{env['TENSORGATE_ADMIN_LISTEN'].rsplit(':', 1)[1]}"

    def start(self):
        name = f"gateway-{len(self.procs)}"
        log = open(self.tmp / f"{name}.log", "w")
        self.procs.append((subprocess.Popen([str(BINARY), "serve"], env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT), log, self.tmp / f"{name}.log"))
        return self.procs[-1][0]

    @property
    def pid(self):
        return self.procs[-1][0].pid

    def upgrade(self):
        old, _, old_log = self.procs[-1]
        new = self.start()
        for _ in range(1200):
            if "Handed over to the new process" in old_log.read_text() or new.poll() is not None:
                break
            time.sleep(0.1)
        assert new.poll() is None, self.procs[-1][2].read_text()
        old.send_signal(signal.SIGTERM)
        assert old.wait(timeout=120) == 0, old_log.read_text()
        with urllib.request.urlopen(f"{self.admin}/readyz") as r:
            assert r.status == 200
        assert "Took the listening sockets over" in self.procs[-1][2].read_text()

    def stop(self):
        for proc, log, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
            log.close()


def engines(admin):
    with urllib.request.urlopen(f"{admin}/v1/memory") as r:
        return [e["model"] for e in json.loads(r.read())["engines"]]


def test_nothing_stops_while_models_keys_configuration_and_the_binary_change(store, tmp_path):
    port, admin_port = free_port(), free_port()
    endpoint = f"http://127.0.0.1:{port}"
    models = tmp_path / "models"
    models.mkdir()
    for name in ("tiny-cnn", "tiny-vit"):
        shutil.copytree(ROOT / "models" / name, models / name)
    add_model(models, "extra", "tiny-extra")
    config = tmp_path / "tensorgate.toml"
    alias_port = free_port()
    settings = ("[pushdown]\nmodels_refresh_secs = 1\n"
                f'[[pushdown.alias_endpoints]]\nlisten = "127.0.0.1:{alias_port}"\nmodel = "tiny-cnn"\nsplit = "pool"\n')
    config.write_text(credentials(("load", LOAD), ("alice", ALICE_OLD), ("carol", CAROL)) + settings)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORGATE_", "ORT_", "AWS_"))}
    env.update(
        TENSORGATE_CONFIG=str(config),
        TENSORGATE_LISTEN=f"127.0.0.1:{port}",
        TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin_port}",
        TENSORGATE_UPGRADE_SOCKET=str(tmp_path / "upgrade.sock"),
        TENSORGATE_MODELS_DIR=str(models),
        TENSORGATE_ORT_LIBRARY=ort_library(),
        TENSORGATE_BACKEND_ENDPOINT=store["endpoint"],
        TENSORGATE_BACKEND_ACCESS_KEY=store["access_key"],
        TENSORGATE_BACKEND_SECRET_KEY=store["secret_key"],
        TENSORGATE_BACKEND_TRAILING_CHECKSUMS=str(STORE_KIND == "seaweedfs").lower(),
        TENSORGATE_LOG="info",
    )
    node = Node(tmp_path, env)
    try:
        wait_ready(node.admin, node.start())
        s3 = client(endpoint, "load", LOAD)
        bucket = f"nodowntime-{uuid.uuid4().hex[:8]}"
        s3.create_bucket(Bucket=bucket)
        png = io.BytesIO()
        Image.fromarray(np.random.default_rng(3).integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(png, "PNG")
        s3.put_object(Bucket=bucket, Key="img.png", Body=png.getvalue())
        want = [{(m, s): pushdown_get(s3, bucket, "img.png", model=m, split=s)["Body"].read()
                 for m, splits in p.items() for s in splits} for p in PUSHDOWNS]
        extra = pushdown_get(s3, bucket, "img.png", model="tiny-extra", split="pool")["Body"].read()
        assert extra == want[0][("tiny-cnn", "pool")]
        alice_old, carol = client(endpoint, "alice", ALICE_OLD), client(endpoint, "carol", CAROL)
        alice_old.list_buckets()
        carol.list_buckets()

        started = time.monotonic()
        deadline = started + MAX_SECONDS
        stop, failures = threading.Event(), []
        counts = [0] * 8
        threads = [threading.Thread(target=objects, args=(endpoint, bucket, n, stop, failures, counts, deadline))
                   for n in range(6)]
        alias = (f"http://127.0.0.1:{alias_port}", want[0][("tiny-cnn", "pool")])
        threads += [threading.Thread(target=pushdowns, args=(endpoint, bucket, 6 + i, stop, failures, counts,
                                                             deadline, want[i], alias if i == 0 else None))
                    for i in range(2)]
        for t in threads:
            t.start()

        def some_load():
            """Waits (bounded) until every client finished one more round, or one failed."""
            before = list(counts)
            for _ in range(600):
                if failures or all(c > b for c, b in zip(counts, before)):
                    return
                time.sleep(0.1)

        some_load()
        # A model added: served within the rescan period, equal to the weights it copies.
        add_model(models, "new", "tiny-new")
        until(lambda: any(m["name"] == "tiny-new" for m in listing(node.admin)["models"]), "tiny-new served")
        assert pushdown_get(s3, bucket, "img.png", model="tiny-new", split="pool")["Body"].read() == extra
        # A model removed: no longer served, its engines' memory back in the budget.
        assert "tiny-extra" in engines(node.admin)
        shutil.rmtree(models / "extra")
        until(lambda: all(m["name"] != "tiny-extra" for m in listing(node.admin)["models"]), "tiny-extra removed")
        until(lambda: "tiny-extra" not in engines(node.admin), "tiny-extra's engines stopped")
        with pytest.raises(ClientError) as e:
            pushdown_get(s3, bucket, "img.png", model="tiny-extra", split="pool")
        assert e.value.response["Error"]["Code"] == "InvalidArgument"

        some_load()
        node.upgrade()
        some_load()

        # alice's secret rotated (SIGHUP to the upgraded process): the old one refused on its
        # kept-alive connection from the next request.
        config.write_text(credentials(("load", LOAD), ("alice", ALICE_NEW), ("carol", CAROL)) + settings)
        hang_up(node.pid, node.admin, "applied")
        refused(alice_old, "SignatureDoesNotMatch")
        alice_new = client(endpoint, "alice", ALICE_NEW)
        alice_new.list_buckets()
        # A bad file changes nothing; then carol revoked through the admin API.
        config.write_text("[[credentials]\naccess_key = ")
        status, body = admin_reload(node.admin, proof(alice_new))
        assert status == 400, body
        alice_new.list_buckets()
        carol.list_buckets()
        config.write_text(credentials(("load", LOAD), ("alice", ALICE_NEW)) + settings)
        status, body = admin_reload(node.admin, proof(alice_new))
        assert (status, body["changed"]) == (200, ["credentials"]), body
        refused(carol, "InvalidAccessKeyId")
        assert [metric(node.admin, f'tensorgate_config_reloads_total{{outcome="{o}"}}') for o in ("applied", "invalid")] \
            == [2, 1]

        some_load()
        node.upgrade()
        # The new process reads the file as it is now: the revoked and rotated keys stay refused.
        refused(carol, "InvalidAccessKeyId")
        refused(alice_old, "SignatureDoesNotMatch")
        alice_new.list_buckets()
        assert any(m["name"] == "tiny-new" for m in listing(node.admin)["models"])
        assert all(m["name"] != "tiny-extra" for m in listing(node.admin)["models"])

        # The load goes on for the whole period (bounded), then every client must have passed.
        while time.monotonic() < started + LOAD_SECONDS and not failures:
            time.sleep(0.5)
        some_load()
        stop.set()
        for t in threads:
            t.join(timeout=180)
        assert not failures, failures
        assert all(c > 0 for c in counts), counts
        print(f"no downtime on {STORE_KIND}: {sum(counts)} rounds by 8 clients in "
              f"{time.monotonic() - started:.0f} s, 0 failed")
    finally:
        node.stop()
