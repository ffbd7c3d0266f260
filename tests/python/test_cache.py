"""The tensor cache, through the real gateway binary and SeaweedFS: epochs after the first are
served from the cache with identical bytes, writes through the gateway are never served stale,
out-of-band writes are caught as documented (docs/pushdown.md, "Tensor cache"), concurrent misses
compute once, and the disk tier survives a restart only with its integrity intact."""

import concurrent.futures
import io
import time
import urllib.error
import urllib.request

import botocore.exceptions
import numpy as np
import pytest

from conftest import direct_client, metric, run_gateway
from test_pushdown import npy_bytes, pushdown_get, reference

SPEC = dict(model="tiny-cnn", split="pool")


def sample(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((3, 32, 32), dtype=np.float32)


def get(s3, bucket, key, **extra):
    r = pushdown_get(s3, bucket, key, **{**SPEC, **extra})
    return r["Body"].read(), r["ResponseMetadata"]["HTTPHeaders"]


def features(body: bytes) -> np.ndarray:
    return np.load(io.BytesIO(body))


def test_second_epoch_is_served_from_cache_with_identical_bytes(gateway, s3, bucket):
    _, admin, _ = gateway
    for i in range(4):
        s3.put_object(Bucket=bucket, Key=f"e/{i}.npy", Body=npy_bytes(sample(i)))
    misses = metric(admin, "tensorgate_cache_misses_total")
    # Each epoch's requests in their own order, as the loader sends them (`seq`): not part of the
    # output, so the second epoch still finds the first's.
    epoch1 = [get(s3, bucket, f"e/{i}.npy", seq=f"epoch1.{i}") for i in range(4)]
    assert [h["x-tensorgate-cache"] for _, h in epoch1] == ["miss"] * 4
    assert metric(admin, "tensorgate_cache_misses_total") == misses + 4
    computed = metric(admin, 'tensorgate_pushdown_requests_total{model="tiny-cnn",split="pool"}')
    epoch2 = [get(s3, bucket, f"e/{i}.npy", seq=f"epoch2.{i}") for i in range(4)]
    # The default revalidates every request with a conditional GET: no recomputation.
    assert [h["x-tensorgate-cache"] for _, h in epoch2] == ["revalidated"] * 4
    assert metric(admin, 'tensorgate_pushdown_requests_total{model="tiny-cnn",split="pool"}') == computed
    for (b1, h1), (b2, h2) in zip(epoch1, epoch2):
        assert b1 == b2 and h1["etag"] == h2["etag"]
    np.testing.assert_array_equal(features(epoch2[2][0]), reference("tiny-cnn", "pool", sample(2)[None])[0])
    assert metric(admin, 'tensorgate_cache_revalidations_total{outcome="unchanged"}') >= 4
    assert metric(admin, 'tensorgate_cache_resident_bytes{tier="memory"}') > 0
    assert metric(admin, 'tensorgate_cache_served_bytes_total{tier="memory"}') >= sum(len(b) for b, _ in epoch2)


def test_head_and_range_are_served_from_cache(gateway, s3, bucket):
    s3.put_object(Bucket=bucket, Key="hr.npy", Body=npy_bytes(sample(7)))
    full, _ = get(s3, bucket, "hr.npy")

    def add(request, **_):
        for k, v in SPEC.items():
            request.headers[f"x-tensorgate-{k}"] = v
        request.headers["range"] = "bytes=10-29"

    s3.meta.events.register_first("before-sign.s3.GetObject", add)
    s3.meta.events.register_first("before-sign.s3.HeadObject", add)
    try:
        part = s3.get_object(Bucket=bucket, Key="hr.npy")
        head = s3.head_object(Bucket=bucket, Key="hr.npy")
    finally:
        s3.meta.events.unregister("before-sign.s3.GetObject", add)
        s3.meta.events.unregister("before-sign.s3.HeadObject", add)
    assert part["Body"].read() == full[10:30]
    assert part["ResponseMetadata"]["HTTPHeaders"]["x-tensorgate-cache"] != "miss"
    assert part["ContentRange"] == f"bytes 10-29/{len(full)}"
    assert head["ResponseMetadata"]["HTTPHeaders"]["x-tensorgate-cache"] != "miss"


TRUSTING = "[pushdown.cache]\nrevalidate_after_ms = 600000\n"


def test_writes_through_the_gateway_are_never_served_stale(seaweed, tmp_path):
    """With a ten-minute trust window, only invalidation keeps outputs fresh: every kind of write
    through the gateway must be followed by the new object's features (or its absence)."""
    with run_gateway(tmp_path, TRUSTING, seaweed=seaweed) as (_, admin, s3, _):
        b = f"stale-{int(time.time() * 1000) % 10**9}"
        s3.create_bucket(Bucket=b)
        s3.put_object(Bucket=b, Key="x.npy", Body=npy_bytes(sample(1)))

        def expect(seed, key="x.npy"):
            body, h = get(s3, b, key)
            np.testing.assert_array_equal(features(body), reference("tiny-cnn", "pool", sample(seed)[None])[0])
            return h["x-tensorgate-cache"]

        assert expect(1) == "miss"
        assert expect(1) == "hit"  # trusted: the backend is not asked
        s3.put_object(Bucket=b, Key="x.npy", Body=npy_bytes(sample(2)))
        assert expect(2) == "miss"
        s3.put_object(Bucket=b, Key="src.npy", Body=npy_bytes(sample(3)))
        s3.copy_object(Bucket=b, Key="x.npy", CopySource={"Bucket": b, "Key": "src.npy"})
        assert expect(3) == "miss"
        mp = s3.create_multipart_upload(Bucket=b, Key="x.npy")
        part = s3.upload_part(Bucket=b, Key="x.npy", UploadId=mp["UploadId"], PartNumber=1, Body=npy_bytes(sample(4)))
        s3.complete_multipart_upload(
            Bucket=b, Key="x.npy", UploadId=mp["UploadId"],
            MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
        )
        assert expect(4) == "miss"
        s3.delete_object(Bucket=b, Key="x.npy")
        with pytest.raises(botocore.exceptions.ClientError) as e:
            get(s3, b, "x.npy")
        assert e.value.response["Error"]["Code"] == "NoSuchKey"
        s3.put_object(Bucket=b, Key="x.npy", Body=npy_bytes(sample(5)))
        assert expect(5) == "miss"
        assert expect(5) == "hit"
        s3.delete_objects(Bucket=b, Delete={"Objects": [{"Key": "x.npy"}]})
        with pytest.raises(botocore.exceptions.ClientError) as e:
            get(s3, b, "x.npy")
        assert e.value.response["Error"]["Code"] == "NoSuchKey"
        assert metric(admin, "tensorgate_cache_hits_total") >= 2


def test_out_of_band_writes_are_caught_by_revalidation(seaweed, tmp_path):
    """Writes straight to the store: the default (revalidate every request) serves the new
    features at once; a trust window serves the old ones until it ends, then the new ones."""
    direct = direct_client(seaweed)
    b = f"oob-{int(time.time() * 1000) % 10**9}"
    direct.create_bucket(Bucket=b)
    direct.put_object(Bucket=b, Key="x.npy", Body=npy_bytes(sample(1)))
    ref = lambda seed: reference("tiny-cnn", "pool", sample(seed)[None])[0]  # noqa: E731

    with run_gateway(tmp_path, "", seaweed=seaweed) as (_, admin, s3, _):
        get(s3, b, "x.npy")
        direct.put_object(Bucket=b, Key="x.npy", Body=npy_bytes(sample(2)))
        body, h = get(s3, b, "x.npy")
        np.testing.assert_array_equal(features(body), ref(2))
        assert h["x-tensorgate-cache"] == "miss"
        assert metric(admin, 'tensorgate_cache_revalidations_total{outcome="changed"}') == 1

    # A window no run of this test outlasts (10 minutes): within it, the documented staleness.
    with run_gateway(tmp_path, "[pushdown.cache]\nrevalidate_after_ms = 600000\n", seaweed=seaweed) as (_, _, s3, _):
        get(s3, b, "x.npy")
        direct.put_object(Bucket=b, Key="x.npy", Body=npy_bytes(sample(3)))
        body, h = get(s3, b, "x.npy")
        np.testing.assert_array_equal(features(body), ref(2))
        assert h["x-tensorgate-cache"] == "hit"
    # A window every run outlasts (1 ms, and 20 ms pass): past it, the store is asked again.
    with run_gateway(tmp_path, "[pushdown.cache]\nrevalidate_after_ms = 1\n", seaweed=seaweed) as (_, _, s3, _):
        get(s3, b, "x.npy")
        direct.put_object(Bucket=b, Key="x.npy", Body=npy_bytes(sample(4)))
        time.sleep(0.02)
        body, h = get(s3, b, "x.npy")
        np.testing.assert_array_equal(features(body), ref(4))
        assert h["x-tensorgate-cache"] == "miss"


def test_concurrent_misses_compute_once(gateway, s3, bucket):
    import boto3
    from botocore.config import Config

    from conftest import CLIENT_AK, CLIENT_SK

    endpoint, admin, _ = gateway
    clients = [
        boto3.session.Session().client(
            "s3", endpoint_url=endpoint, aws_access_key_id=CLIENT_AK, aws_secret_access_key=CLIENT_SK,
            region_name="us-east-1", config=Config(s3={"addressing_style": "path"}),
        )
        for _ in range(8)
    ]
    x = np.random.default_rng(11).random((16, 3, 32, 32), dtype=np.float32)
    s3.put_object(Bucket=bucket, Key="burst.npy", Body=npy_bytes(x))
    label = '{model="tiny-cnn",split="block1"}'
    before = metric(admin, f"tensorgate_pushdown_requests_total{label}")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda c: pushdown_get(c, bucket, "burst.npy", model="tiny-cnn", split="block1")["Body"].read(), clients))
    assert len(set(results)) == 1
    assert metric(admin, f"tensorgate_pushdown_requests_total{label}") == before + 1


def test_disk_tier_survives_restart_and_drops_damage(seaweed, tmp_path):
    disk = tmp_path / "tensors"
    # A memory tier too small for any output: every hit below comes from disk.
    cfg = f'[pushdown.cache]\nmemory_bytes = 1024\ndisk_dir = "{disk}"\ndisk_bytes = 10000000\n'
    b = f"disk-{int(time.time() * 1000) % 10**9}"
    with run_gateway(tmp_path, cfg, seaweed=seaweed) as (_, _, s3, _):
        s3.create_bucket(Bucket=b)
        for i in range(3):
            s3.put_object(Bucket=b, Key=f"{i}.npy", Body=npy_bytes(sample(i)))
        first = [get(s3, b, f"{i}.npy", split="block1") for i in range(3)]
        deadline = time.time() + 10
        while len(list(disk.glob("*.tgc"))) < 3 and time.time() < deadline:
            time.sleep(0.05)
        assert len(list(disk.glob("*.tgc"))) == 3
    # Damage one entry's body: it must be recomputed, not served.
    victim = sorted(disk.glob("*.tgc"))[0]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with run_gateway(tmp_path, cfg, seaweed=seaweed) as (_, admin, s3, _):
        again = [get(s3, b, f"{i}.npy", split="block1") for i in range(3)]
        assert [x[0] for x in again] == [x[0] for x in first]
        statuses = sorted((h["x-tensorgate-cache"], h.get("x-tensorgate-cache-tier")) for _, h in again)
        assert statuses == [("miss", None), ("revalidated", "disk"), ("revalidated", "disk")], statuses
        assert metric(admin, "tensorgate_cache_corrupt_entries_total") == 1


def test_anonymous_pushdowns_ask_the_store_even_when_cached(seaweed, tmp_path):
    """With `allow_anonymous`, an anonymous pushdown fetches unsigned, so the store decides; an
    output cached for a signed client (even inside a trust window) is never served to an anonymous
    one without the store answering that request first."""
    # With anonymous access on, the development key is only there when configured.
    config = (
        'allow_anonymous = true\n[[credentials]]\naccess_key = "tensorgate-dev"\nsecret_key = "tensorgate-dev-secret"\n'
        + TRUSTING
    )
    with run_gateway(tmp_path, config, seaweed=seaweed) as (endpoint, _, s3, _):
        bucket = f"anon-{int(time.time() * 1000) % 10**9}"
        s3.create_bucket(Bucket=bucket)
        s3.put_object(Bucket=bucket, Key="private.npy", Body=npy_bytes(sample(3)))
        body, headers = get(s3, bucket, "private.npy")
        assert headers["x-tensorgate-cache"] == "miss"
        assert get(s3, bucket, "private.npy")[1]["x-tensorgate-cache"] == "hit"
        url = f"{endpoint}/{bucket}/private.npy?tensorgate-model=tiny-cnn&tensorgate-split=pool"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=10)
        # SeaweedFS grants anonymous requests nothing: its 403, not the cached tensor.
        assert e.value.code == 403
        assert b"AccessDenied" in e.value.read()


def test_a_computation_whose_client_went_away_finishes_into_the_cache(gateway, s3, bucket):
    """Issue 49: a reader whose SDK gives up on a slow first read and retries is served the
    output its first request computed, not a second computation."""
    import boto3
    from botocore.config import Config

    from conftest import CLIENT_AK, CLIENT_SK

    endpoint, admin, _ = gateway
    x = np.random.default_rng(12).random((48, 224, 224, 3), dtype=np.float32)
    s3.put_object(Bucket=bucket, Key="slow.npy", Body=npy_bytes(x))
    label = '{model="resnet50-thin",split="pool"}'
    before = metric(admin, f"tensorgate_pushdown_requests_total{label}")
    impatient = boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=CLIENT_AK, aws_secret_access_key=CLIENT_SK,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, read_timeout=0.2, retries={"max_attempts": 1}))
    with pytest.raises(botocore.exceptions.ReadTimeoutError):
        pushdown_get(impatient, bucket, "slow.npy", model="resnet50-thin", split="pool")
    for _ in range(600):
        if metric(admin, f"tensorgate_pushdown_requests_total{label}") > before:
            break
        time.sleep(0.1)
    body, headers = get(s3, bucket, "slow.npy", model="resnet50-thin")
    assert headers["x-tensorgate-cache"] in ("hit", "revalidated"), headers
    assert features(body).shape[0] == 48
    assert metric(admin, f"tensorgate_pushdown_requests_total{label}") == before + 1
