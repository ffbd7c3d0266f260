"""Tenants as themselves (transparent identity mode, ADR 0013): the gateway holds no client secret
and no store key; the store's own users sign, and the store decides every request, pushdowns and
cached features included. Runs against the store TENSORGATE_TEST_STORE names (SeaweedFS by
default; scripts/test.sh runs it on Ceph RGW and Swift too), each with two users made by its
script: A (the main user) and B (the second user, who owns none of A's buckets)."""

import contextlib
import io
import itertools
import os
import socket
import subprocess
import urllib.error
import urllib.parse
import urllib.request

import boto3
import botocore.exceptions
import botocore.handlers
import numpy as np
import pytest
from botocore.config import Config

from conftest import BINARY, ROOT, STORE_KIND, free_port, metric, run_gateway, wait_ready
from test_pushdown import MODELS, npy_bytes, pushdown_get, reference, rel_l2

pytestmark = pytest.mark.skipif(STORE_KIND == "fs", reason="the embedded backend has no users of its own")

MODEL, SPLIT = "tiny-cnn", "pool"
_names = itertools.count()


@contextlib.contextmanager
def transparent_gateway(store, logdir, config: str = "", ports=None):
    """A gateway in front of the store with no client key and no store key, so transparent
    (`backend.identity = "auto"`); yields (S3 endpoint, admin endpoint, log path)."""
    with run_gateway(logdir, config, env={"TENSORGATE_BACKEND_ENDPOINT": store["endpoint"]}, ports=ports) as gw:
        endpoint, admin, _, _ = gw
        yield endpoint, admin, logdir / f"gateway-{endpoint.rsplit(':', 1)[1]}.log"


@pytest.fixture(scope="module")
def gateway_t(store, tmp_path_factory):
    with transparent_gateway(store, tmp_path_factory.mktemp("gw-transparent")) as gw:
        yield gw


def client(endpoint: str, ak: str, sk: str):
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ak, aws_secret_access_key=sk,
                        region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))


@pytest.fixture()
def users(gateway_t, store):
    """(A through the gateway, B through the gateway, A direct, B direct)."""
    a, b = (store["access_key"], store["secret_key"]), (store["alt_access_key"], store["alt_secret_key"])
    return (client(gateway_t[0], *a), client(gateway_t[0], *b), client(store["endpoint"], *a),
            client(store["endpoint"], *b))


def answer(call):
    """(status, S3 error code) of a boto3 call; (200, None) when it succeeded."""
    try:
        r = call()
        if "Body" in r:
            r["Body"].read()
        return r["ResponseMetadata"]["HTTPStatusCode"], None
    except botocore.exceptions.ClientError as e:
        return e.response["ResponseMetadata"]["HTTPStatusCode"], e.response["Error"].get("Code")


def cache_state(resp) -> str | None:
    return resp["ResponseMetadata"]["HTTPHeaders"].get("x-tensorgate-cache")


def private_sample(a, seed: int):
    """A private bucket of A's with one sample; returns (bucket, key, input array)."""
    bucket = f"idn-{os.getpid()}-{next(_names)}"
    a.create_bucket(Bucket=bucket)
    x = np.random.default_rng(seed).random(MODELS[MODEL][1], dtype=np.float32)
    a.put_object(Bucket=bucket, Key="x.npy", Body=npy_bytes(x))
    return bucket, "x.npy", x


def test_store_keys_push_down_and_the_output_is_the_reference(users, gateway_t):
    a, _, _, _ = users
    bucket, key, x = private_sample(a, 1)
    first = pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)
    body = first["Body"].read()
    y = np.load(io.BytesIO(body))
    assert rel_l2(y, reference(MODEL, SPLIT, x[None])[0]) <= 1e-5
    assert cache_state(first) == "miss"
    # Cached, and served only after the store said yes to this caller on this request.
    again = pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)
    assert cache_state(again) == "revalidated"
    assert again["Body"].read() == body


def test_another_user_gets_what_the_store_answers_never_a_cached_feature(users, gateway_t):
    """B is refused A's private object, its listing, an overwrite and its features, even right
    after A's pushdown cached them; each answer through the gateway is the store's own answer to B
    directly. B's refusals do not evict A's cached features."""
    a, b, a_direct, b_direct = users
    _, admin, _ = gateway_t
    bucket, key, x = private_sample(a, 2)
    assert cache_state(pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)) == "miss"
    refused_before = metric(admin, 'tensorgate_cache_revalidations_total{outcome="refused"}')

    calls = {
        "get": lambda c: c.get_object(Bucket=bucket, Key=key),
        "head": lambda c: c.head_object(Bucket=bucket, Key=key),
        "list": lambda c: c.list_objects_v2(Bucket=bucket),
        "put": lambda c: c.put_object(Bucket=bucket, Key=key, Body=b"overwritten by B"),
        "delete": lambda c: c.delete_object(Bucket=bucket, Key="other"),
    }
    for name, call in calls.items():
        through, direct = answer(lambda: call(b)), answer(lambda: call(b_direct))
        assert through == direct, name
        assert through[0] in (403, 404), (name, through)

    # B's pushdowns: header triggers, query triggers in a presigned URL, HEAD, a Range.
    direct = answer(lambda: b_direct.get_object(Bucket=bucket, Key=key))
    for _ in range(2):
        assert answer(lambda: pushdown_get(b, bucket, key, model=MODEL, split=SPLIT)) == direct
    from tensorgate.client import Client

    url = Client(gateway_t[0], b._request_signer._credentials.access_key,
                 b._request_signer._credentials.secret_key).presign(bucket, key, MODEL, SPLIT)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url)
    assert e.value.code == direct[0]
    assert "x-tensorgate-cache" not in e.value.headers

    # Nothing of A's changed, and A's cached features are still served (after the store's yes).
    assert a_direct.get_object(Bucket=bucket, Key=key)["Body"].read() == npy_bytes(x)
    assert cache_state(pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)) == "revalidated"
    assert metric(admin, 'tensorgate_cache_revalidations_total{outcome="refused"}') >= refused_before + 3


def test_each_user_works_in_its_own_buckets(users):
    """B's own bucket (named alt-* for SeaweedFS's scoped identity): B writes, reads and pushes
    down with its own key, multipart upload included."""
    _, b, _, b_direct = users
    bucket = f"alt-idn-{os.getpid()}-{next(_names)}"
    b.create_bucket(Bucket=bucket)
    x = np.random.default_rng(3).random(MODELS[MODEL][1], dtype=np.float32)
    b.put_object(Bucket=bucket, Key="x.npy", Body=npy_bytes(x))
    got = pushdown_get(b, bucket, "x.npy", model=MODEL, split=SPLIT)
    assert cache_state(got) == "miss"
    y = np.load(io.BytesIO(got["Body"].read()))
    assert rel_l2(y, reference(MODEL, SPLIT, x[None])[0]) <= 1e-5
    big = os.urandom(11 * 1024 * 1024)
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    b.upload_fileobj(io.BytesIO(big), bucket, "big.bin", Config=cfg)
    assert b_direct.get_object(Bucket=bucket, Key="big.bin")["Body"].read() == big


def test_a_wrong_secret_is_refused_by_the_store_even_for_cached_features(users, gateway_t, store):
    a, _, _, _ = users
    bucket, key, _ = private_sample(a, 4)
    assert cache_state(pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)) == "miss"
    forged = client(gateway_t[0], store["access_key"], "not-the-secret")
    forged_direct = client(store["endpoint"], store["access_key"], "not-the-secret")
    direct = answer(lambda: forged_direct.get_object(Bucket=bucket, Key=key))
    assert direct[0] == 403
    assert answer(lambda: pushdown_get(forged, bucket, key, model=MODEL, split=SPLIT)) == direct
    assert answer(lambda: forged.get_object(Bucket=bucket, Key=key)) == direct


def test_a_changed_or_deleted_source_is_seen_on_the_next_request(users):
    a, _, a_direct, _ = users
    bucket, key, _ = private_sample(a, 5)
    assert cache_state(pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)) == "miss"
    x2 = np.random.default_rng(6).random(MODELS[MODEL][1], dtype=np.float32)
    a_direct.put_object(Bucket=bucket, Key=key, Body=npy_bytes(x2))  # behind the gateway's back
    changed = pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)
    assert cache_state(changed) == "miss"
    y = np.load(io.BytesIO(changed["Body"].read()))
    assert rel_l2(y, reference(MODEL, SPLIT, x2[None])[0]) <= 1e-5
    a_direct.delete_object(Bucket=bucket, Key=key)
    assert answer(lambda: pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)) == (404, "NoSuchKey")


def test_head_and_range_are_served_once_the_output_is_cached(users):
    """A signed HEAD or Range reads only part of the source with the caller's authority, so a cold
    one is refused with a clear error, unless the store answered the Range with every byte (a
    block larger than the object, as s3fs asks): then that is the whole source, and the output is
    computed. Once cached, HEAD and Range are answered from the cache."""
    a, _, _, _ = users
    bucket, key, _ = private_sample(a, 7)

    def head():
        def add(request, **_):
            request.headers["x-tensorgate-model"], request.headers["x-tensorgate-split"] = MODEL, SPLIT

        a.meta.events.register_first("before-sign.s3.HeadObject", add)
        try:
            return a.head_object(Bucket=bucket, Key=key)
        finally:
            a.meta.events.unregister("before-sign.s3.HeadObject", add)

    def ranged(spec="bytes=0-9"):
        def add(request, **_):
            request.headers["x-tensorgate-model"], request.headers["x-tensorgate-split"] = MODEL, SPLIT

        a.meta.events.register_first("before-sign.s3.GetObject", add)
        try:
            return a.get_object(Bucket=bucket, Key=key, Range=spec)
        finally:
            a.meta.events.unregister("before-sign.s3.GetObject", add)

    assert answer(head) == (400, "400")  # a HEAD error has no body: botocore names the status
    assert answer(ranged) == (400, "InvalidRequest")
    block = ranged("bytes=0-8388607")  # 8 MiB, far beyond the sample
    assert block["ResponseMetadata"]["HTTPStatusCode"] == 206 and cache_state(block) == "miss"
    output = block["Body"].read()
    assert block["ContentRange"] == f"bytes 0-{len(output) - 1}/{len(output)}"
    whole = pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)
    assert cache_state(whole) == "revalidated"
    assert whole["Body"].read() == output
    size = len(output)
    h = head()
    assert h["ContentLength"] == size and cache_state(h) == "revalidated"
    r = ranged()
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 206 and len(r["Body"].read()) == 10
    assert cache_state(r) == "revalidated"

    # A Range the signature does not cover (a presigned URL signs only `host`) refers to the
    # output: the gateway leaves it out of the source read, so a cold one is computed.
    from tensorgate.client import Client

    bucket, key, x = private_sample(a, 8)
    creds = a._request_signer._credentials
    url = Client(a.meta.endpoint_url, creds.access_key, creds.secret_key).presign(bucket, key, MODEL, SPLIT)
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=0-9"})) as r:
        assert r.status == 206 and r.headers["x-tensorgate-cache"] == "miss"
        part, total = r.read(), int(r.headers["Content-Range"].split("/")[1])
    whole = pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)
    assert cache_state(whole) == "revalidated"
    output = whole["Body"].read()
    assert part == output[:10] and total == len(output)
    assert rel_l2(np.load(io.BytesIO(output)), reference(MODEL, SPLIT, x[None])[0]) <= 1e-5


@pytest.fixture()
def vhost_names(monkeypatch):
    """<bucket>.localhost resolves to loopback in this process (the stores' scripts and the
    gateway below take `localhost` as their virtual-host domain; glibc does not resolve
    subdomains of localhost by itself)."""
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if isinstance(host, str) and host.endswith(".localhost"):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


def test_virtual_host_requests_reach_the_store_as_signed(store, tmp_path, vhost_names):
    """Virtual-host addressing (Host `<bucket>.localhost:<port>`, as SDKs send by default): the
    gateway routes by its `domains`, forwards the Host the client signed, and the store, set up
    with the same domain, decides. Every answer equals the store's own to the same request, and
    a pushdown reads its source with the caller's virtual-host request."""
    with transparent_gateway(store, tmp_path, 'domains = ["localhost"]') as (endpoint, _, _):

        def vclient(at, ak, sk):
            c = boto3.client("s3", endpoint_url=at.replace("127.0.0.1", "localhost"), aws_access_key_id=ak,
                             aws_secret_access_key=sk, region_name="us-east-1",
                             config=Config(s3={"addressing_style": "virtual"}, retries={"max_attempts": 1}))
            hosts = []
            c.meta.events.register("before-send.s3", lambda request, **_: hosts.append(request.url.split("/")[2]))
            return c, hosts

        keys = (store["access_key"], store["secret_key"]), (store["alt_access_key"], store["alt_secret_key"])
        (a, a_hosts), (b, _) = (vclient(endpoint, *k) for k in keys)
        (a_direct, _), (b_direct, _) = (vclient(store["endpoint"], *k) for k in keys)
        bucket = f"vh-{os.getpid()}-{next(_names)}"
        a.create_bucket(Bucket=bucket)
        x = np.random.default_rng(11).random(MODELS[MODEL][1], dtype=np.float32)
        a.put_object(Bucket=bucket, Key="x.npy", Body=npy_bytes(x))
        assert a.get_object(Bucket=bucket, Key="x.npy")["Body"].read() == npy_bytes(x)
        assert [o["Key"] for o in a.list_objects_v2(Bucket=bucket)["Contents"]] == ["x.npy"]
        assert a_direct.get_object(Bucket=bucket, Key="x.npy")["Body"].read() == npy_bytes(x)
        first = pushdown_get(a, bucket, "x.npy", model=MODEL, split=SPLIT)
        y = np.load(io.BytesIO(first["Body"].read()))
        assert rel_l2(y, reference(MODEL, SPLIT, x[None])[0]) <= 1e-5
        assert cache_state(first) == "miss"
        assert cache_state(pushdown_get(a, bucket, "x.npy", model=MODEL, split=SPLIT)) == "revalidated"
        # B gets the store's own answer, for the object and for its features alike.
        refused = answer(lambda: b_direct.get_object(Bucket=bucket, Key="x.npy"))
        assert refused[0] in (403, 404)
        assert answer(lambda: b.get_object(Bucket=bucket, Key="x.npy")) == refused
        assert answer(lambda: pushdown_get(b, bucket, "x.npy", model=MODEL, split=SPLIT)) == refused
        # Every request through the gateway went as virtual-host style.
        assert a_hosts and all(h.startswith(f"{bucket}.localhost:") for h in a_hosts), a_hosts
        a.delete_object(Bucket=bucket, Key="x.npy")
        a.delete_bucket(Bucket=bucket)


# The second user's id in the store's ACL grants.
ALT_GRANTEE = {"seaweedfs": "alt", "ceph-rgw": "alt", "swift": "test2:tester2"}


def test_an_acl_grant_and_its_revocation_take_effect_on_the_next_request(users):
    """A grants B read on one object, then revokes it. Through the gateway B gets exactly what the
    store gives B directly at each step, features included: on a store that honours the grant
    (Ceph RGW), B's pushdown is served (from A's cached features, after the store's yes) while the
    grant stands and refused right after the revocation."""
    a, b, a_direct, b_direct = users
    bucket, key, _ = private_sample(a, 8)
    assert cache_state(pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)) == "miss"
    granted = answer(lambda: a.put_object_acl(Bucket=bucket, Key=key, GrantRead=f"id={ALT_GRANTEE[STORE_KIND]}",
                                              GrantFullControl=f"id={store_user_id(a_direct)}"))
    direct = answer(lambda: b_direct.get_object(Bucket=bucket, Key=key))
    via = pushdown_get(b, bucket, key, model=MODEL, split=SPLIT) if direct[0] == 200 else None
    if direct[0] == 200:
        assert cache_state(via) == "revalidated"
    else:
        assert answer(lambda: pushdown_get(b, bucket, key, model=MODEL, split=SPLIT)) == direct
    if STORE_KIND == "ceph-rgw":
        assert granted[0] == 200 and direct[0] == 200, (granted, direct)
    answer(lambda: a.put_object_acl(Bucket=bucket, Key=key, ACL="private"))  # Swift's s3api: NotImplemented
    revoked = answer(lambda: b_direct.get_object(Bucket=bucket, Key=key))
    assert answer(lambda: pushdown_get(b, bucket, key, model=MODEL, split=SPLIT)) == revoked
    if STORE_KIND == "ceph-rgw":
        assert revoked[0] == 403


def store_user_id(c) -> str:
    """The store's canonical id of a client's user (the bucket owner of its own buckets)."""
    return c.list_buckets()["Owner"]["ID"]


@pytest.mark.skipif(STORE_KIND != "seaweedfs", reason="the README's store is a SeaweedFS on 127.0.0.1:8333")
def test_the_readme_transparent_example_runs_as_written():
    """The README's one-line transparent gateway, verbatim, in front of a SeaweedFS at the address
    it names: the store's own users read, write and push down with their own keys; the second
    user is refused the first one's object."""
    import re
    import shlex

    section = (ROOT / "README.md").read_text().split("## In front of an existing store")[1]
    command = re.search(r"```sh\n(tensorgate serve[^\n]*)\n```", section).group(1)
    env = dict(os.environ, SEAWEED_PORT="8333")
    subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "start"], env=env, check=True, capture_output=True)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORGATE_", "AWS_", "ORT_"))}
    run_env["PATH"] = f"{BINARY.parent}:{run_env['PATH']}"
    proc = subprocess.Popen(shlex.split(command), cwd=ROOT, env=run_env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready("http://127.0.0.1:9001", proc)
        a = client("http://127.0.0.1:9000", "seaweed-ak", "seaweed-sk")
        b = client("http://127.0.0.1:9000", "seaweed-alt-ak", "seaweed-alt-sk")
        bucket, key, x = private_sample(a, 9)
        y = np.load(io.BytesIO(pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)["Body"].read()))
        assert rel_l2(y, reference(MODEL, SPLIT, x[None])[0]) <= 1e-5
        assert answer(lambda: pushdown_get(b, bucket, key, model=MODEL, split=SPLIT))[0] == 403
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "stop"], env=env, check=False)


def test_a_plan_is_proven_by_the_store_and_changes_only_that_users_split(gateway_t, store, users):
    """Transparent mode: the admin API holds no secret, so the store checks the proof (the
    tenant's own presigned ListBuckets); A's plan changes A's `split=auto` and nobody else's."""
    import json

    from tensorgate.client import Client
    from test_python_client import get_plan, post_plan

    endpoint, admin, _ = gateway_t
    a = Client(endpoint, store["access_key"], store["secret_key"], admin=admin)
    forged = Client(endpoint, store["access_key"], "not-the-secret")
    b = Client(endpoint, store["alt_access_key"], store["alt_secret_key"])
    profile = {"batch_size": 8, "samples": 800, "train_secs_per_batch": 0.001, "raw_bytes_per_sample": 1e6,
               "bandwidth_bytes_per_sec": 1e4,
               "compute_secs_per_sample": {"none": 1e-4, "stem": 5e-5, "block2": 2e-5, "pool": 0.0}}

    def status(proof, **fields):
        try:
            post_plan(admin, MODEL, profile, proof, **fields)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)["error"]
        return 200, None

    assert status(None) == (403, "AccessDenied")
    assert status(forged.proof()) == (403, "AccessDenied")
    assert status(b.proof(), tenant=store["access_key"]) == (403, "AccessDenied")
    assert status(a.proof()) == (200, None)

    # Reading a plan is proven by the store too: each user sees only its own.
    assert get_plan(admin, MODEL, a.proof()) is not None
    assert get_plan(admin, MODEL, b.proof()) is None
    assert get_plan(admin, MODEL, b.proof(), tenant=store["access_key"]) == 403
    assert get_plan(admin, MODEL, forged.proof()) == 403

    # split=auto follows A's plan for A; a caller who only claims A's key gets the store's refusal
    # and nothing of A's plan.
    a_s3, _, _, _ = users
    bucket, key, _ = private_sample(a_s3, 9)
    got = pushdown_get(a_s3, bucket, key, model=MODEL, split="auto")
    headers = got["ResponseMetadata"]["HTTPHeaders"]
    assert headers["x-tensorgate-split"] == get_plan(admin, MODEL, a.proof())["chosen"]
    assert "x-tensorgate-plan" in headers
    forged_s3 = client(endpoint, store["access_key"], "not-the-secret")
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        pushdown_get(forged_s3, bucket, key, model=MODEL, split="auto")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert "x-tensorgate-plan" not in refused.value.response["ResponseMetadata"]["HTTPHeaders"]


def test_terminating_mode_with_a_store_key_per_client_keeps_users_apart(store, tmp_path):
    """Terminating mode, each `[[credentials]]` entry with its own store key and no shared one:
    every request reaches the store as that client's store user, so the store keeps telling them
    apart; cached features are served to a client only after the store said yes to its user."""
    config = (
        '[[credentials]]\naccess_key = "tenant-a"\nsecret_key = "tenant-a-secret"\n'
        f'store_access_key = "{store["access_key"]}"\nstore_secret_key = "{store["secret_key"]}"\n'
        '[[credentials]]\naccess_key = "tenant-b"\nsecret_key = "tenant-b-secret"\n'
        f'store_access_key = "{store["alt_access_key"]}"\nstore_secret_key = "{store["alt_secret_key"]}"\n'
    )
    with run_gateway(tmp_path, config, env={"TENSORGATE_BACKEND_ENDPOINT": store["endpoint"]}) as (endpoint, *_):
        a, b = client(endpoint, "tenant-a", "tenant-a-secret"), client(endpoint, "tenant-b", "tenant-b-secret")
        b_direct = client(store["endpoint"], store["alt_access_key"], store["alt_secret_key"])
        bucket, key, _ = private_sample(a, 10)
        assert cache_state(pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)) == "miss"
        direct = answer(lambda: b_direct.get_object(Bucket=bucket, Key=key))
        assert direct[0] in (403, 404)
        assert answer(lambda: b.get_object(Bucket=bucket, Key=key)) == direct
        assert answer(lambda: pushdown_get(b, bucket, key, model=MODEL, split=SPLIT)) == direct
        assert cache_state(pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)) == "revalidated"
        own = f"alt-keys-{os.getpid()}"
        b.create_bucket(Bucket=own)
        b.put_object(Bucket=own, Key="k", Body=b"b's")
        assert b_direct.get_object(Bucket=own, Key="k")["Body"].read() == b"b's"  # stored as B's


@pytest.mark.skipif(STORE_KIND != "ceph-rgw", reason="of the three stores, Ceph RGW has tenants")
def test_a_tenant_users_presigned_urls_and_their_preflights_work_as_directly(store, tmp_path):
    """Terminating mode with a store key per client, the client a user of an RGW tenant
    (scripts/ceph-rgw.sh makes `s3t$tenanted`): a presigned GET, and the CORS preflights of that
    URL, get what RGW answers them directly (the preflight goes to RGW as that client, so RGW looks
    in its tenant); a bucket named across tenants (`s3t:bucket`) reaches the store."""
    import requests

    ak, sk = "rgw-tenant-ak", "rgw-tenant-sk"
    config = (f'[[credentials]]\naccess_key = "{ak}"\nsecret_key = "{sk}"\n'
              f'store_access_key = "{ak}"\nstore_secret_key = "{sk}"\n'
              f'[[credentials]]\naccess_key = "{store["access_key"]}"\nsecret_key = "{store["secret_key"]}"\n'
              f'store_access_key = "{store["access_key"]}"\nstore_secret_key = "{store["secret_key"]}"\n')
    v4 = Config(s3={"addressing_style": "path"}, signature_version="s3v4", retries={"max_attempts": 1})
    with run_gateway(tmp_path, config, env={"TENSORGATE_BACKEND_ENDPOINT": store["endpoint"]}) as (endpoint, *_):
        via = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ak, aws_secret_access_key=sk,
                           region_name="us-east-1", config=v4)
        direct = boto3.client("s3", endpoint_url=store["endpoint"], aws_access_key_id=ak, aws_secret_access_key=sk,
                              region_name="us-east-1", config=v4)
        bucket = f"tenanted-{os.getpid()}-{next(_names)}"
        via.create_bucket(Bucket=bucket, ACL="public-read")
        via.put_object(Bucket=bucket, Key="foo", Body=b"tenant's", ACL="public-read")
        asked = {"Origin": "example", "Access-Control-Request-Method": "GET"}

        def answers(c) -> list[int]:
            url = c.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "foo"}, ExpiresIn=600)
            return [requests.get(url, timeout=10).status_code, requests.options(url, timeout=10).status_code,
                    requests.options(url, headers=asked, timeout=10).status_code]

        assert answers(via) == answers(direct) == [200, 400, 403]
        via.put_bucket_cors(Bucket=bucket, CORSConfiguration={
            "CORSRules": [{"AllowedMethods": ["GET"], "AllowedOrigins": ["example"]}]})
        assert answers(via) == answers(direct) == [200, 400, 200]
        # The global tenant's user reads the tenant's public bucket by its name across tenants.
        main = client(endpoint, store["access_key"], store["secret_key"])
        main.meta.events.unregister("before-parameter-build.s3", botocore.handlers.validate_bucket_name)
        assert main.get_object(Bucket=f"s3t:{bucket}", Key="foo")["Body"].read() == b"tenant's"


def test_a_transparent_cluster_routes_the_callers_own_request_to_the_owner(store, tmp_path, users):
    """Three transparent members, no hop secret: a pushdown asked of any member is computed by
    the object's owner, which reads the source with the caller's own request (so the store
    decides there) and keeps the only cached copy; another user is refused at every member."""
    from tensorgate.cluster import rank
    from test_cluster import cluster_config, wait_states

    a_any, _, _, b_direct = users
    members = [{"id": f"t-{i}", "s3": f"http://127.0.0.1:{free_port()}", "admin": f"http://127.0.0.1:{free_port()}"}
               for i in range(3)]
    with contextlib.ExitStack() as stack:
        for m in members:
            ports = (int(m["s3"].rsplit(":", 1)[1]), int(m["admin"].rsplit(":", 1)[1]))
            stack.enter_context(transparent_gateway(store, tmp_path, cluster_config(m["id"], members), ports))
        wait_states([m["admin"] for m in members], ["ready"] * 3)
        bucket, key, x = private_sample(a_any, 11)
        owner = rank([m["id"] for m in members], bucket, key)[0]
        states = []
        for m in members:
            a = client(m["s3"], store["access_key"], store["secret_key"])
            got = pushdown_get(a, bucket, key, model=MODEL, split=SPLIT)
            headers = got["ResponseMetadata"]["HTTPHeaders"]
            assert headers["x-tensorgate-computed-by"] == owner
            y = np.load(io.BytesIO(got["Body"].read()))
            assert rel_l2(y, reference(MODEL, SPLIT, x[None])[0]) <= 1e-5
            states.append(cache_state(got))
        assert states == ["miss", "revalidated", "revalidated"]  # one copy, at the owner
        direct = answer(lambda: b_direct.get_object(Bucket=bucket, Key=key))
        for m in members:
            b = client(m["s3"], store["alt_access_key"], store["alt_secret_key"])
            assert answer(lambda: pushdown_get(b, bucket, key, model=MODEL, split=SPLIT)) == direct


@pytest.mark.skipif(STORE_KIND != "ceph-rgw", reason="of the three stores, Ceph RGW issues STS session credentials")
def test_sts_session_credentials_work_through_the_gateway(users, gateway_t, store):
    """A role made with RGW's IAM API and assumed through its STS: the temporary key, secret and
    session token (`x-amz-security-token`, signed) read, write and push down through the gateway
    as they do directly; an expired or forged token is refused by the store."""
    import json

    a, _, _, _ = users
    bucket, key, x = private_sample(a, 12)
    own = {"aws_access_key_id": store["access_key"], "aws_secret_access_key": store["secret_key"]}
    iam = boto3.client("iam", endpoint_url=store["endpoint"], region_name="us-east-1", **own)
    role = f"tg-{os.getpid()}-{next(_names)}"
    trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {"AWS": ["arn:aws:iam:::user/tester"]},
                                                     "Action": ["sts:AssumeRole"]}]}
    compact = {"separators": (",", ":")}  # RGW 16's policy parser refuses JSON with spaces
    iam.create_role(RoleName=role, Path="/", AssumeRolePolicyDocument=json.dumps(trust, **compact))
    allow = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:*"], "Resource": "arn:aws:s3:::*"}]}
    iam.put_role_policy(RoleName=role, PolicyName="all", PolicyDocument=json.dumps(allow, **compact))
    sts = boto3.client("sts", endpoint_url=store["endpoint"], region_name="us-east-1", **own)
    creds = sts.assume_role(RoleArn=f"arn:aws:iam:::role/{role}", RoleSessionName="tg")["Credentials"]
    session = boto3.client("s3", endpoint_url=gateway_t[0], region_name="us-east-1",
                           aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                           aws_session_token=creds["SessionToken"],
                           config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
    session.put_object(Bucket=bucket, Key="by-session", Body=b"session write")
    assert session.get_object(Bucket=bucket, Key="by-session")["Body"].read() == b"session write"
    got = pushdown_get(session, bucket, key, model=MODEL, split=SPLIT)
    y = np.load(io.BytesIO(got["Body"].read()))
    assert rel_l2(y, reference(MODEL, SPLIT, x[None])[0]) <= 1e-5
    forged = boto3.client("s3", endpoint_url=gateway_t[0], region_name="us-east-1",
                          aws_access_key_id=creds["AccessKeyId"], aws_secret_access_key=creds["SecretAccessKey"],
                          aws_session_token=creds["SessionToken"][:-4] + "AAAA",
                          config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
    assert answer(lambda: pushdown_get(forged, bucket, key, model=MODEL, split=SPLIT))[0] in (400, 403)
