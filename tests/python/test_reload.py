"""Configuration reloaded while serving (SIGHUP and `POST /v1/config/reload`), in front of
SeaweedFS in terminating mode: client keys added, rotated and revoked take effect from the next
request, on kept-alive connections and for cached outputs too; a bad file and a key that needs a
restart change nothing."""

import io
import json
import os
import signal
import time
import urllib.error
import urllib.request

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from PIL import Image

from conftest import metric, run_gateway
from test_pushdown import pushdown_get

ALICE_OLD, ALICE_NEW, BOB, CAROL = "alice-secret-one", "alice-secret-two", "bob-secret", "carol-secret"


def credentials(*pairs: tuple[str, str]) -> str:
    return "".join(f'[[credentials]]\naccess_key = "{k}"\nsecret_key = "{s}"\n\n' for k, s in pairs)


def client(endpoint: str, key: str, secret: str):
    """One boto3 client: its pool keeps the connection alive between requests."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, signature_version="s3v4", retries={"max_attempts": 1}),
    )


def refused(c, code: str) -> None:
    with pytest.raises(ClientError) as e:
        c.list_buckets()
    assert e.value.response["Error"]["Code"] == code


def reloads(admin: str, outcome: str) -> float:
    return metric(admin, f'tensorgate_config_reloads_total{{outcome="{outcome}"}}')


def hang_up(pid: int, admin: str, outcome: str) -> None:
    """Sends SIGHUP and waits (at most 100 looks) until the reload it causes is counted."""
    before = reloads(admin, outcome)
    os.kill(pid, signal.SIGHUP)
    for _ in range(100):
        if reloads(admin, outcome) > before:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {outcome} reload counted after SIGHUP")


def proof(c) -> str:
    """A presigned SigV4 ListBuckets URL: a proof of `c`'s key for the admin API."""
    return c.generate_presigned_url("list_buckets", ExpiresIn=60)


def admin_reload(admin: str, proof: str | None) -> tuple[int, dict]:
    req = urllib.request.Request(f"{admin}/v1/config/reload", method="POST", data=b"",
                                 headers={"x-tensorgate-proof": proof} if proof else {})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_keys_are_added_rotated_and_revoked_without_a_restart(tmp_path, seaweed):
    with run_gateway(tmp_path, credentials(("alice", ALICE_OLD), ("carol", CAROL)), seaweed=seaweed) as (
        endpoint, admin, dev, pid,
    ):
        # run_gateway wrote the configuration it started from here.
        config = next(tmp_path.glob("gateway-*.toml"))
        alice_old, carol = client(endpoint, "alice", ALICE_OLD), client(endpoint, "carol", CAROL)
        alice_new, bob = client(endpoint, "alice", ALICE_NEW), client(endpoint, "bob", BOB)
        dev.create_bucket(Bucket="reload")
        png = io.BytesIO()
        Image.new("RGB", (40, 36), (200, 30, 90)).save(png, format="PNG")
        dev.put_object(Bucket="reload", Key="img.png", Body=png.getvalue())
        # Before: alice's first secret and carol work; carol's pushdown output is now cached.
        alice_old.list_buckets()
        carol_features = pushdown_get(carol, "reload", "img.png", model="tiny-cnn", split="pool")["Body"].read()
        refused(alice_new, "SignatureDoesNotMatch")
        refused(bob, "InvalidAccessKeyId")

        # alice's secret rotated, bob added, carol revoked.
        config.write_text(credentials(("alice", ALICE_NEW), ("bob", BOB)))
        hang_up(pid, admin, "applied")
        refused(alice_old, "SignatureDoesNotMatch")  # on its kept-alive connection
        alice_new.list_buckets()
        bob.list_buckets()
        refused(carol, "InvalidAccessKeyId")
        with pytest.raises(ClientError) as e:
            pushdown_get(carol, "reload", "img.png", model="tiny-cnn", split="pool")
        assert e.value.response["Error"]["Code"] == "InvalidAccessKeyId", "no cached output for a revoked key"
        assert pushdown_get(bob, "reload", "img.png", model="tiny-cnn", split="pool")["Body"].read() == carol_features

        # A file that does not parse changes nothing.
        config.write_text("[[credentials]\naccess_key = ")
        hang_up(pid, admin, "invalid")
        alice_new.list_buckets()
        bob.list_buckets()

        # A change that needs a restart is refused by name, with the rest of the file: bob stays.
        config.write_text("shutdown_grace_secs = 5\n" + credentials(("alice", ALICE_NEW)) + "[pushdown]\nmax_batch = 4\n")
        status, body = admin_reload(admin, None)
        assert status == 403, body
        status, body = admin_reload(admin, proof(alice_new))
        assert status == 409, body
        assert body["fixed"] == ["shutdown_grace_secs", "pushdown"], body
        assert reloads(admin, "fixed") == 1
        bob.list_buckets()

        # The same through the admin API, applied: bob revoked.
        config.write_text(credentials(("alice", ALICE_NEW)))
        status, body = admin_reload(admin, proof(alice_new))
        assert (status, body["changed"]) == (200, ["credentials"]), body
        refused(bob, "InvalidAccessKeyId")
        alice_new.list_buckets()
        dev.list_buckets()  # the development pair comes from the flags, which a reload applies again
        assert reloads(admin, "applied") == 2
