"""Real S3 clients through the real gateway binary in front of a real store (SeaweedFS by default;
TENSORGATE_TEST_STORE=ceph-rgw or swift for the others): nothing but the endpoint changes."""

import io
import json
import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import boto3
import botocore.exceptions
import pytest
from boto3.s3.transfer import TransferConfig

from conftest import BINARY, CLIENT_AK, CLIENT_SK, ROOT, STORE_KIND, TRANSPARENT, free_port, wait_ready

AWS = str(ROOT / ".venv" / "bin" / "aws")


def test_boto3_objects_multipart_listing_presign(s3, bucket, tmp_path):
    s3.put_object(Bucket=bucket, Key="a.txt", Body=b"hello", Metadata={"k": "v"})
    got = s3.get_object(Bucket=bucket, Key="a.txt")
    assert got["Body"].read() == b"hello"
    assert got["Metadata"] == {"k": "v"}

    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(12 * 1024 * 1024))
    cfg = TransferConfig(multipart_threshold=5 * 1024 * 1024, multipart_chunksize=5 * 1024 * 1024)
    s3.upload_file(str(big), bucket, "big.bin", Config=cfg)
    head = s3.head_object(Bucket=bucket, Key="big.bin")
    assert head["ContentLength"] == big.stat().st_size
    assert head["ETag"].endswith('-3"')
    out = tmp_path / "out.bin"
    s3.download_file(bucket, "big.bin", str(out), Config=cfg)
    assert out.read_bytes() == big.read_bytes()

    for i in range(5):
        s3.put_object(Bucket=bucket, Key=f"p/{i}", Body=b"x")
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix="p/", PaginationConfig={"PageSize": 2})
    assert [o["Key"] for page in pages for o in page.get("Contents", [])] == [f"p/{i}" for i in range(5)]
    # Current boto3 sends DeleteObjects without Content-MD5, which Swift's s3api requires: the
    # gateway adds it, so this works on every store.
    deleted = s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": f"p/{i}"} for i in range(5)]})
    assert sorted(d["Key"] for d in deleted["Deleted"]) == [f"p/{i}" for i in range(5)]
    assert "Contents" not in s3.list_objects_v2(Bucket=bucket, Prefix="p/")

    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "a.txt"}, ExpiresIn=60)
    with urllib.request.urlopen(url) as r:
        assert r.read() == b"hello"

    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket=bucket, Key="missing")
    assert e.value.response["Error"]["Code"] == "NoSuchKey"


@pytest.mark.skipif(TRANSPARENT, reason="the store verifies SigV2 in transparent mode (RGW 16.2 refuses botocore's)")
def test_boto3_sigv2_manages_buckets_and_objects(gateway):
    """boto3 with legacy SigV2 (`signature_version="s3"`): it signs a path-style bucket request
    (`PUT /bucket`) with the slash it does not send (`/bucket/`); the gateway verifies that and the
    resource as sent, so bucket and object operations work; a wrong secret is refused."""
    from botocore.config import Config

    cfg = Config(signature_version="s3", s3={"addressing_style": "path"}, retries={"max_attempts": 1})
    v2 = boto3.client("s3", endpoint_url=gateway[0], aws_access_key_id=CLIENT_AK, aws_secret_access_key=CLIENT_SK,
                      region_name="us-east-1", config=cfg)
    name = f"sigv2-{os.getpid()}"
    v2.create_bucket(Bucket=name)
    v2.put_object(Bucket=name, Key="k", Body=b"v2")
    assert [o["Key"] for o in v2.list_objects(Bucket=name)["Contents"]] == ["k"]
    assert v2.get_object(Bucket=name, Key="k")["Body"].read() == b"v2"
    wrong = boto3.client("s3", endpoint_url=gateway[0], aws_access_key_id=CLIENT_AK, aws_secret_access_key="wrong",
                         region_name="us-east-1", config=cfg)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        wrong.create_bucket(Bucket=f"{name}-x")
    assert e.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    v2.delete_object(Bucket=name, Key="k")
    v2.delete_bucket(Bucket=name)


def test_boto3_wrong_secret_is_refused(gateway, bucket, store):
    endpoint, _, _ = gateway

    def refusal(url):
        bad = boto3.client("s3", endpoint_url=url, aws_access_key_id=CLIENT_AK, aws_secret_access_key="wrong",
                           region_name="us-east-1")
        with pytest.raises(botocore.exceptions.ClientError) as e:
            bad.list_objects_v2(Bucket=bucket)
        return e.value.response["ResponseMetadata"]["HTTPStatusCode"], e.value.response["Error"]["Code"]

    if TRANSPARENT:
        # The store decides, and answers as it would directly (Ceph RGW with STS enabled says
        # AccessDenied where the others say SignatureDoesNotMatch).
        assert refusal(endpoint) == refusal(store["endpoint"])
        assert refusal(endpoint)[0] == 403
    else:
        assert refusal(endpoint) == (403, "SignatureDoesNotMatch")


def test_aws_cli_cp_multipart_sync_presign(gateway, bucket, client_env, tmp_path):
    endpoint, _, _ = gateway
    aws = [AWS, "--endpoint-url", endpoint]
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(20 * 1024 * 1024))  # above the CLI's 8 MiB multipart threshold
    subprocess.run(aws + ["s3", "cp", str(big), f"s3://{bucket}/big.bin"], env=client_env, check=True, capture_output=True)
    back = tmp_path / "back.bin"
    subprocess.run(aws + ["s3", "cp", f"s3://{bucket}/big.bin", str(back)], env=client_env, check=True, capture_output=True)
    assert back.read_bytes() == big.read_bytes()

    src = tmp_path / "tree"
    (src / "sub").mkdir(parents=True)
    for name in ["one.txt", "sub/two.txt", "sub/three.txt"]:
        (src / name).write_text(name)
    subprocess.run(aws + ["s3", "sync", str(src), f"s3://{bucket}/tree"], env=client_env, check=True, capture_output=True)
    listing = subprocess.run(aws + ["s3", "ls", "--recursive", f"s3://{bucket}/tree/"], env=client_env, check=True, capture_output=True, text=True).stdout
    assert all(n in listing for n in ["tree/one.txt", "tree/sub/two.txt", "tree/sub/three.txt"]), listing
    dest = tmp_path / "synced"
    subprocess.run(aws + ["s3", "sync", f"s3://{bucket}/tree", str(dest)], env=client_env, check=True, capture_output=True)
    assert (dest / "sub" / "two.txt").read_text() == "sub/two.txt"

    url = subprocess.run(aws + ["s3", "presign", f"s3://{bucket}/tree/one.txt", "--expires-in", "60"], env=client_env, check=True, capture_output=True, text=True).stdout.strip()
    with urllib.request.urlopen(url) as r:
        assert r.read() == b"one.txt"
    subprocess.run(aws + ["s3", "rm", "--recursive", f"s3://{bucket}/tree"], env=client_env, check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("rclone") is None, reason="rclone not installed (scripts/setup.sh installs it as root)")
def test_rclone(gateway, bucket, tmp_path):
    endpoint, _, _ = gateway
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_"))}
    env.update(
        RCLONE_CONFIG_TG_TYPE="s3",
        RCLONE_CONFIG_TG_PROVIDER="Other",
        RCLONE_CONFIG_TG_ENDPOINT=endpoint,
        RCLONE_CONFIG_TG_ACCESS_KEY_ID=CLIENT_AK,
        RCLONE_CONFIG_TG_SECRET_ACCESS_KEY=CLIENT_SK,
        RCLONE_CONFIG_TG_REGION="us-east-1",
        RCLONE_CONFIG_TG_FORCE_PATH_STYLE="true",
    )
    src = tmp_path / "src"
    src.mkdir()
    (src / "r.txt").write_text("via rclone")
    (src / "big.bin").write_bytes(os.urandom(6 * 1024 * 1024))
    subprocess.run(["rclone", "copy", str(src), f"tg:{bucket}/rc"], env=env, check=True, capture_output=True)
    cat = subprocess.run(["rclone", "cat", f"tg:{bucket}/rc/r.txt"], env=env, check=True, capture_output=True, text=True).stdout
    assert cat == "via rclone"
    check = subprocess.run(["rclone", "check", str(src), f"tg:{bucket}/rc"], env=env, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


@pytest.mark.skipif(shutil.which("s3cmd") is None, reason="s3cmd not installed (scripts/setup.sh installs it as root)")
def test_s3cmd(gateway, bucket, tmp_path):
    endpoint, _, _ = gateway
    hostport = endpoint.removeprefix("http://")
    cfg = tmp_path / "s3cfg"
    cfg.write_text(
        f"[default]\naccess_key = {CLIENT_AK}\nsecret_key = {CLIENT_SK}\nhost_base = {hostport}\nhost_bucket = {hostport}\n"
        "use_https = False\nsignature_v2 = False\nbucket_location = us-east-1\n"
    )
    f = tmp_path / "s.txt"
    f.write_text("via s3cmd")
    base = ["s3cmd", "-c", str(cfg)]
    subprocess.run(base + ["put", str(f), f"s3://{bucket}/s.txt"], check=True, capture_output=True)
    ls = subprocess.run(base + ["ls", f"s3://{bucket}/"], check=True, capture_output=True, text=True).stdout
    assert "s.txt" in ls
    out = tmp_path / "o.txt"
    subprocess.run(base + ["get", f"s3://{bucket}/s.txt", str(out)], check=True, capture_output=True)
    assert out.read_text() == "via s3cmd"


def test_gateway_log_has_no_secrets(gateway, store, s3, bucket):
    _, _, log = gateway
    s3.put_object(Bucket=bucket, Key="k", Body=b"x")
    text = Path(log).read_text()
    assert "Request served." in text
    assert CLIENT_SK not in text and (store["secret_key"] or CLIENT_SK) not in text


def test_embedded_default_needs_no_configuration(tmp_path):
    """`tensorgate` with no flags, env or file: fs backend in ./tensorgate-data, development key."""
    for port in (9000, 9001):
        with __import__("socket").socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.skip(f"port {port} is in use on this machine")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
    # Run from a copy of the repository layout the README assumes: models/ and .venv beside.
    (tmp_path / "models").symlink_to(ROOT / "models")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    proc = subprocess.Popen([str(BINARY)], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready("http://127.0.0.1:9001", proc)
        c = boto3.client("s3", endpoint_url="http://127.0.0.1:9000", aws_access_key_id="tensorgate-dev", aws_secret_access_key="tensorgate-dev-secret", region_name="us-east-1")
        listed = [o["Key"] for o in c.list_objects_v2(Bucket="demo")["Contents"]]
        assert listed == ["sample-0.png", "sample-1.png", "sample-2.png"], listed
        c.put_object(Bucket="demo", Key="hello.txt", Body=b"embedded")
        assert c.get_object(Bucket="demo", Key="hello.txt")["Body"].read() == b"embedded"
        assert (tmp_path / "tensorgate-data" / "demo" / "hello.txt").read_bytes() == b"embedded"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen("http://127.0.0.1:9000/demo/hello.txt")
        assert e.value.code == 403
        # The README's one-line pushdown: curl signs the request itself (SigV4, query included).
        url = "http://127.0.0.1:9000/demo/sample-0.png?tensorgate-model=tiny-cnn&tensorgate-split=pool"
        out = subprocess.run(
            ["curl", "-sf", "--aws-sigv4", "aws:amz:us-east-1:s3", "--user", "tensorgate-dev:tensorgate-dev-secret", url],
            check=True, capture_output=True,
        ).stdout
        import io

        import numpy as np

        assert np.load(io.BytesIO(out)).shape == (16, 1, 1)
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_presigned_post_form_upload(s3, bucket, store):
    """boto3's generate_presigned_post, then an HTML form upload as a browser sends it: the policy's
    conditions hold at the gateway, the object lands on the store, and a form that breaks the policy
    stores nothing."""
    import requests

    post = s3.generate_presigned_post(
        bucket,
        "uploads/${filename}",
        Fields={"Content-Type": "text/plain", "x-amz-meta-origin": "form"},
        Conditions=[
            ["starts-with", "$key", "uploads/"],
            {"Content-Type": "text/plain"},
            {"x-amz-meta-origin": "form"},
            ["content-length-range", 1, 1024 * 1024],
        ],
        ExpiresIn=300,
    )
    r = requests.post(post["url"], data=post["fields"], files={"file": ("note.txt", b"posted from a form")}, timeout=30)
    if TRANSPARENT and r.status_code != 204:
        # The store decides POST forms in transparent mode; one without POST Object (Swift's
        # s3api) answers through the gateway exactly as it answers directly.
        direct = requests.post(f"{store['endpoint']}/{bucket}", data=post["fields"],
                               files={"file": ("note.txt", b"posted from a form")}, timeout=30)
        assert (r.status_code, r.text) == (direct.status_code, direct.text)
        assert store["kind"] == "swift", r.text
        return
    assert r.status_code == 204, r.text
    got = s3.get_object(Bucket=bucket, Key="uploads/note.txt")
    assert got["Body"].read() == b"posted from a form"
    assert got["ContentType"] == "text/plain"
    assert got["Metadata"] == {"origin": "form"}

    def refused(data, files, status, code):
        """A form the policy does not allow. Terminating mode: the gateway checks the policy and
        answers `status`/`code`. Transparent mode: the store decides, so the gateway's answer is
        the store's own answer to the same form sent to it directly (stores differ here)."""
        r = requests.post(post_url, data=data, files=files, timeout=60)
        if not TRANSPARENT:
            assert r.status_code == status and code in r.text, r.text
            return
        direct = requests.post(f"{store['endpoint']}/{bucket}", data=data, files=files, timeout=60)
        error = lambda t: re.search(r"<Code>([^<]*)</Code>", t).group(1) if "<Code>" in t else None
        assert (r.status_code, error(r.text)) == (direct.status_code, error(direct.text)), (r.text, direct.text)

    post_url = post["url"]
    # A field the policy does not cover is refused; a file over the policy's range too.
    refused(dict(post["fields"], success_action_status="201"), {"file": ("x.txt", b"x")}, 403, "AccessDenied")
    refused(post["fields"], {"file": ("big.txt", b"y" * (1024 * 1024 + 1))}, 400, "EntityTooLarge")
    tampered = dict(post["fields"], **{"x-amz-meta-origin": "elsewhere"})
    refused(tampered, {"file": ("evil.txt", b"evil")}, 403, "AccessDenied")
    if not TRANSPARENT:
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="uploads/").get("Contents", [])]
        assert keys == ["uploads/note.txt"]
        # Form fields before the file are bounded (64 KiB): a huge one is refused before anything else.
        huge = dict(post["fields"], **{"x-ignore-padding": "p" * (100 * 1024)})
        r = requests.post(post["url"], data=huge, files={"file": ("h.txt", b"h")}, timeout=30)
        assert r.status_code == 400 and "MaxPostPreDataLengthExceeded" in r.text, r.text

    # success_action_status 201 answers S3's XML document.
    post201 = s3.generate_presigned_post(
        bucket, "created.txt", Fields={"success_action_status": "201"}, Conditions=[{"success_action_status": "201"}]
    )
    r = requests.post(post201["url"], data=post201["fields"], files={"file": ("c.txt", b"created")}, timeout=30)
    assert r.status_code == 201, r.text
    assert "<Key>created.txt</Key>" in r.text and f"<Bucket>{bucket}</Bucket>" in r.text, r.text

    # A large file streams through (the gateway never holds it whole).
    post = s3.generate_presigned_post(bucket, "large.bin", Conditions=[["content-length-range", 0, 64 * 1024 * 1024]])
    data = os.urandom(12 * 1024 * 1024 + 7)
    r = requests.post(post["url"], data=post["fields"], files={"file": ("large.bin", data)}, timeout=120)
    assert r.status_code == 204, r.text
    assert s3.get_object(Bucket=bucket, Key="large.bin")["Body"].read() == data


# --- listings: every parameter form S3 accepts, the embedded backend against a real store -----

LISTING_KEYS = ["a.txt", "d/1", "d/2 x", "d/sub/3", "d/sub/4+plus", "d/é", "d/pct%", "d/amp&1", "e/5",
                "f*/6", "f*/g/7", "f-/8"]
# (query, extra signed headers): the CRT form first (empty delimiter, as AWS CRT-based loaders send
# it), then each parameter S3 documents, in ListObjectsV2 and ListObjects (v1) form.
LISTING_REQUESTS = [
    ({"list-type": "2", "delimiter": "", "max-keys": "1000", "prefix": "d/"}, {}),
    ({"list-type": "2", "delimiter": ""}, {}),
    ({"list-type": "2", "delimiter": "/"}, {}),
    ({"list-type": "2", "delimiter": "/", "prefix": "d/", "encoding-type": "url"}, {}),
    ({"list-type": "2", "prefix": "", "start-after": "d/2 x", "encoding-type": "url"}, {}),
    ({"list-type": "2", "prefix": "d/", "fetch-owner": "true"}, {}),
    ({"list-type": "2", "prefix": "d/", "max-keys": "3"}, {}),  # paged with continuation tokens
    ({"list-type": "2", "delimiter": "/", "max-keys": "2", "encoding-type": "url"}, {}),
    ({"list-type": "2", "prefix": "d/"}, {"x-amz-optional-object-attributes": "RestoreStatus"}),
    ({"list-type": "2", "delimiter": "*/"}, {}),  # a delimiter of two characters
    ({"delimiter": "", "prefix": "d/"}, {}),
    ({"marker": "d/2 x", "encoding-type": "url"}, {}),
    ({"delimiter": "/", "prefix": "d/", "max-keys": "2", "encoding-type": "url"}, {}),  # paged with markers
    ({"prefix": "e", "delimiter": "/", "marker": ""}, {}),
]


def signed_get(endpoint: str, path: str, query: dict, headers: dict, creds: tuple[str, str]):
    """A GET signed with SigV4 exactly as given (botocore's signer; no parameter added or dropped)."""
    import urllib.parse

    import requests
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    qs = urllib.parse.urlencode(query, quote_via=urllib.parse.quote, safe="")
    req = AWSRequest(method="GET", url=f"{endpoint}{path}?{qs}" if qs else f"{endpoint}{path}", headers=headers)
    S3SigV4Auth(Credentials(*creds), "s3", "us-east-1").add_auth(req)
    return requests.get(req.url, headers=dict(req.headers), timeout=30)


def parsed_listing(body: bytes, encoded: bool) -> dict:
    """A listing page as data: names decoded when the request asked for `encoding-type=url`."""
    import urllib.parse
    import xml.etree.ElementTree as ET

    dec = urllib.parse.unquote_plus if encoded else (lambda s: s)
    root = ET.fromstring(body)
    for el in root.iter():
        el.tag = el.tag.split("}")[-1]
    text = lambda el, name: (el.findtext(name) or "")  # noqa: E731
    return {
        "contents": [(dec(text(c, "Key")), int(text(c, "Size")), text(c, "ETag")) for c in root.findall("Contents")],
        "prefixes": [dec(text(p, "Prefix")) for p in root.findall("CommonPrefixes")],
        "truncated": text(root, "IsTruncated"),
        "key_count": text(root, "KeyCount"),
        "echo": {n: dec(text(root, n)) for n in ("Prefix", "Delimiter", "StartAfter", "Marker", "EncodingType")},
        "next": text(root, "NextContinuationToken") or dec(text(root, "NextMarker")),
    }


def list_all(endpoint: str, bucket: str, query: dict, headers: dict, creds) -> list:
    """Every page of a listing (following continuation tokens or markers), as data."""
    pages, query = [], dict(query)
    for _ in range(20):  # bounded: the keys fill at most 12 pages of 1
        r = signed_get(endpoint, f"/{bucket}", query, headers, creds)
        if r.status_code != 200:
            return [("status", r.status_code)]
        page = parsed_listing(r.content, query.get("encoding-type") == "url")
        pages.append({k: v for k, v in page.items() if k != "next"})
        if page["truncated"] != "true":
            return pages
        if query.get("list-type") == "2":
            query["continuation-token"] = page["next"]
        else:  # v1: NextMarker, else the last key (S3 sends NextMarker only with a delimiter)
            query["marker"] = page["next"] or page["contents"][-1][0]
    raise AssertionError("a listing that never ends")


@pytest.mark.skipif(STORE_KIND == "fs", reason="compares the embedded backend with a real store")
def test_embedded_backend_lists_as_the_store_does(gateway, s3, tmp_path):
    """The same keys, the same ListObjects/ListObjectsV2 requests (the CRT form with an empty
    `delimiter=`, `encoding-type`, `fetch-owner`, `start-after`, markers, paging, the optional
    attributes header): the fs backend answers what the store answers, page by page."""
    from conftest import run_gateway

    name = f"listing-{STORE_KIND}-{os.getpid()}"
    with run_gateway(tmp_path) as (fs_endpoint, _, fs_s3, _):
        for client in (s3, fs_s3):
            client.create_bucket(Bucket=name)
            for key in LISTING_KEYS:
                client.put_object(Bucket=name, Key=key, Body=key.encode())
        for query, headers in LISTING_REQUESTS:
            want = list_all(gateway[0], name, query, headers, (CLIENT_AK, CLIENT_SK))
            got = list_all(fs_endpoint, name, query, headers, ("tensorgate-dev", "tensorgate-dev-secret"))
            assert got == want, (query, headers)
        # The CRT form lists every key under the prefix, none rolled up.
        crt = list_all(fs_endpoint, name, *LISTING_REQUESTS[0], ("tensorgate-dev", "tensorgate-dev-secret"))
        assert [c[0] for c in crt[0]["contents"]] == sorted(k for k in LISTING_KEYS if k.startswith("d/"))
        assert crt[0]["prefixes"] == []


def _key_and_bytes(reader):
    return reader.key, reader.read()


@pytest.mark.skipif(TRANSPARENT, reason="alias buckets need terminating identity mode (ADR 0013)")
def test_crt_based_pytorch_loader_lists_and_reads_plain_and_alias_buckets(gateway, s3, monkeypatch):
    """s3torchconnector, the AWS CRT-based PyTorch loader (its listings send an empty `delimiter=`),
    pointed at the gateway: it lists and reads a plain bucket byte for byte, and an alias bucket
    as features equal to the independent reference (numpy + Python onnxruntime)."""
    import numpy as np
    from s3torchconnector import S3ClientConfig, S3IterableDataset, S3MapDataset
    from torch.utils.data import DataLoader

    from test_pushdown import npy_bytes, reference

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", CLIENT_AK)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", CLIENT_SK)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    try:
        s3.create_bucket(Bucket="alias-target")
    except botocore.exceptions.ClientError as e:
        if e.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise
    rng = np.random.default_rng(27)
    inputs = {f"crt/{i}.npy": rng.random((3, 32, 32), dtype=np.float32) for i in range(4)}
    inputs["crt/sub/4.npy"] = rng.random((3, 32, 32), dtype=np.float32)
    for key, x in inputs.items():
        s3.put_object(Bucket="alias-target", Key=key, Body=npy_bytes(x))
    opts = dict(region="us-east-1", endpoint=gateway[0], s3client_config=S3ClientConfig(force_path_style=True))

    plain = S3IterableDataset.from_prefix("s3://alias-target/crt/", transform=_key_and_bytes, **opts)
    got = dict(DataLoader(plain, batch_size=None, num_workers=0))
    assert got == {k: npy_bytes(x) for k, x in inputs.items()}

    alias = S3MapDataset.from_prefix("s3://alias-tiny-pool/crt/", transform=_key_and_bytes, **opts)
    assert len(alias) == len(inputs)
    for i in range(len(alias)):
        key, body = alias[i]
        feats = np.load(io.BytesIO(body), allow_pickle=False)
        np.testing.assert_allclose(feats, reference("tiny-cnn", "pool", inputs[key][None])[0], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(TRANSPARENT, reason="alias buckets need terminating identity mode (ADR 0013)")
def test_parquet_readers_read_features_through_an_alias_bucket(gateway, s3, tmp_path, monkeypatch):
    """A dataset in Hugging Face's Parquet layout, read through an alias bucket by
    pyarrow (a file, and a dataset sized from the listing), Hugging Face `datasets` (s3fs) and
    Polars (Rust's object_store): each gets the Parquet output (every column but the image, the
    features added), computed once however many ranges and readers ask."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.dataset as pads
    import pyarrow.fs
    import pyarrow.parquet as pq

    from test_parquet import hf_table, jpeg, parquet_bytes
    from test_pushdown import reference, reference_preprocess, rel_l2

    endpoint, admin, _ = gateway
    try:
        s3.create_bucket(Bucket="alias-parquet-src")
    except botocore.exceptions.ClientError as e:
        assert e.response["Error"]["Code"] in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou")
    images = [jpeg(5000 + i, (64, 48)) for i in range(30)]
    # With `datasets`' own description of its columns, as `datasets` writes it.
    hf = {"info": {"features": {"image": {"_type": "Image"},
                                "label": {"names": ["a", "b", "c"], "_type": "ClassLabel"},
                                "caption": {"dtype": "string", "_type": "Value"}}}}
    source = hf_table(images, [i % 3 for i in range(30)]).replace_schema_metadata({"huggingface": json.dumps(hf)})
    data = parquet_bytes(source, row_group_size=12)
    key = f"{STORE_KIND}/train-00000-of-00001.parquet"
    s3.put_object(Bucket="alias-parquet-src", Key=key, Body=data)
    from PIL import Image

    x = np.stack([reference_preprocess(Image.open(io.BytesIO(b)), "tiny-cnn") for b in images]).astype(np.float32)
    want = reference("tiny-cnn", "pool", x).reshape(30, -1)

    def check(table: pa.Table, reader: str):
        assert table.column_names == ["label", "caption", "features"], reader
        assert table.column("label").to_pylist() == source.column("label").to_pylist(), reader
        assert table.column("caption").to_pylist() == source.column("caption").to_pylist(), reader
        got = np.array(table.column("features").to_pylist(), dtype=np.float32)
        assert got.shape == want.shape, reader  # every row's list as long as its features
        assert rel_l2(got, want) <= 1e-3, reader  # JPEG decoders differ, as for single images

    # The listing reports the output's size, the same as HEAD: both from the source's footer,
    # before any feature is computed.
    from conftest import metric

    misses = metric(admin, "tensorgate_cache_misses_total")
    listed = s3.list_objects_v2(Bucket="alias-parquet", Prefix=f"{STORE_KIND}/")["Contents"]
    head = s3.head_object(Bucket="alias-parquet", Key=key)
    assert [(o["Key"], o["Size"], o["ETag"]) for o in listed] == [(key, head["ContentLength"], head["ETag"])]
    assert head["ContentLength"] != len(data)
    assert metric(admin, "tensorgate_cache_misses_total") == misses

    fs = pyarrow.fs.S3FileSystem(access_key=CLIENT_AK, secret_key=CLIENT_SK, endpoint_override=endpoint,
                                 region="us-east-1", scheme="http")
    pf = pq.ParquetFile(fs.open_input_file(f"alias-parquet/{key}"))
    assert pf.metadata.num_row_groups == 3  # the source's row groups
    check(pf.read(), "pyarrow file")
    check(pads.dataset(f"alias-parquet/{STORE_KIND}/", filesystem=fs, format="parquet").to_table(), "pyarrow dataset")

    import polars as pl

    options = {"aws_access_key_id": CLIENT_AK, "aws_secret_access_key": CLIENT_SK, "aws_endpoint_url": endpoint,
               "aws_region": "us-east-1", "aws_allow_http": "true"}
    check(pl.read_parquet(f"s3://alias-parquet/{key}", storage_options=options).to_arrow(), "polars")

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import datasets

    ds = datasets.load_dataset(
        "parquet", data_files=f"s3://alias-parquet/{STORE_KIND}/*.parquet", split="train",
        storage_options={"key": CLIENT_AK, "secret": CLIENT_SK,
                         "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}},
        cache_dir=str(tmp_path / "hf-cache"))
    # A list of floats per row (the column's Parquet type has no length: ADR 0022).
    assert ds.features["features"].feature.dtype == "float32"
    check(ds.data.table, "datasets")
    # Every reader above asked for footers and column chunks: each row group computed once.
    assert metric(admin, "tensorgate_cache_misses_total") == misses + 3


def test_a_parquet_file_is_pushed_down_a_few_row_groups_at_a_time_by_ranged_reads(gateway, s3, bucket):
    """`row-groups` names some row groups of a Parquet file; the gateway reads the
    footer and those groups' bytes by ranges (each an unsigned Range beside the caller's
    signature in transparent mode), so a file of any size goes a few groups per request, each
    group's output cached on its own."""
    import json

    import numpy as np
    import pyarrow.parquet as pq
    from PIL import Image

    from conftest import metric
    from test_parquet import hf_table, jpeg, parquet_bytes, safetensors_of
    from test_pushdown import pushdown_get, reference, reference_preprocess, rel_l2

    _, admin, _ = gateway
    images = [jpeg(7000 + i, (256, 192)) for i in range(48)]
    labels = [i % 5 for i in range(48)]
    data = parquet_bytes(hf_table(images, labels), row_group_size=12)
    assert pq.ParquetFile(io.BytesIO(data)).metadata.num_row_groups == 4
    assert len(data) > 2 * (256 * 1024 + 8)  # larger than the footer read, so the reads are ranged
    s3.put_object(Bucket=bucket, Key="big.parquet", Body=data)
    x = np.stack([reference_preprocess(Image.open(io.BytesIO(b)), "tiny-cnn") for b in images]).astype(np.float32)
    want = reference("tiny-cnn", "pool", x)

    md = pq.ParquetFile(io.BytesIO(data)).metadata

    def span(first: int, last: int) -> int:
        chunks = [md.row_group(g).column(c) for g in range(first, last + 1) for c in range(md.num_columns)]
        starts = [c.dictionary_page_offset if c.has_dictionary_page else c.data_page_offset for c in chunks]
        return max(s + c.total_compressed_size for s, c in zip(starts, chunks)) - min(starts)

    misses = metric(admin, "tensorgate_cache_misses_total")
    for groups, rows in [("1", range(12, 24)), ("2-3", range(24, 48))]:
        got = pushdown_get(s3, bucket, "big.parquet", model="tiny-cnn", split="pool", **{"row-groups": groups})
        headers = got["ResponseMetadata"]["HTTPHeaders"]
        assert headers["x-tensorgate-cache"] == "miss"
        # The footer's tail and the groups' span, not the file.
        first, last = rows.start // 12, (rows.stop - 1) // 12
        assert int(headers["x-tensorgate-source-bytes"]) == 256 * 1024 + 8 + span(first, last) < len(data)
        tensors, meta = safetensors_of(got["Body"].read())
        assert json.loads(meta["keys"]) == [f"train/{i:05d}.jpg" for i in rows]
        assert tensors["labels"].tolist() == [labels[i] for i in rows]
        assert rel_l2(tensors["features"], want[rows.start:rows.stop]) <= 1e-3  # JPEG decoders differ
    assert metric(admin, "tensorgate_cache_misses_total") == misses + 2

    # The same groups again: the cached output (the store asked first where it decides).
    again = pushdown_get(s3, bucket, "big.parquet", model="tiny-cnn", split="pool", **{"row-groups": "1"})
    assert again["ResponseMetadata"]["HTTPHeaders"]["x-tensorgate-cache"] in ("hit", "revalidated")
    assert metric(admin, "tensorgate_cache_misses_total") == misses + 2

    # A Parquet output of groups 2-3 keeps their rows' other columns.
    got = pushdown_get(s3, bucket, "big.parquet", model="tiny-cnn", split="pool", format="parquet",
                       **{"row-groups": "2-3"})
    table = pq.read_table(io.BytesIO(got["Body"].read()))
    assert table.column("label").to_pylist() == labels[24:48]
    assert table.column("caption").to_pylist() == [f"picture {i}" for i in range(24, 48)]

    # A group the file lacks, and row groups of an object that is no Parquet file: 400s that say so.
    # (The footer's read of a small object asks for more bytes than it has: the whole object, as a
    # plain client's suffix Range longer than the object gets it from every store.)
    s3.put_object(Bucket=bucket, Key="one.jpg", Body=images[0])
    whole = s3.get_object(Bucket=bucket, Key="one.jpg", Range=f"bytes=-{len(images[0]) + 1000}")
    assert whole["Body"].read() == images[0]
    for key, groups, says in [("big.parquet", "4", "has 4 row groups"), ("one.jpg", "0", "not one")]:
        with pytest.raises(botocore.exceptions.ClientError) as e:
            pushdown_get(s3, bucket, key, model="tiny-cnn", split="pool", **{"row-groups": groups})
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
        assert says in e.value.response["Error"]["Message"]


@pytest.mark.skipif(TRANSPARENT, reason="alias buckets need terminating identity mode (ADR 0013)")
def test_an_alias_listing_pages_at_most_100_entries_and_a_paginator_gets_them_all(gateway, s3):
    """An alias listing computes each entry's output before answering, so a page holds at most
    100 entries whatever `max-keys` asks (`alias::ALIAS_LISTING_PAGE`); clients page on through
    the store's own continuation (v2) or marker (v1), and every entry's size is its output's."""
    import numpy as np

    from conftest import metric
    from test_pushdown import npy_bytes

    _, admin, _ = gateway
    try:
        s3.create_bucket(Bucket="alias-target")
    except botocore.exceptions.ClientError as e:
        assert e.response["Error"]["Code"] in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists")
    prefix = f"page-{STORE_KIND}/"
    x = np.random.default_rng(3).random((3, 32, 32), dtype=np.float32)
    keys = [f"{prefix}{i:03d}.npy" for i in range(103)]
    for key in keys:
        s3.put_object(Bucket="alias-target", Key=key, Body=npy_bytes(x))
    misses = metric(admin, "tensorgate_cache_misses_total")
    out_size = len(s3.get_object(Bucket="alias-tiny-pool", Key=keys[0])["Body"].read())

    first = s3.list_objects_v2(Bucket="alias-tiny-pool", Prefix=prefix, MaxKeys=1000)
    assert len(first["Contents"]) == 100 and first["IsTruncated"] and first["KeyCount"] == 100
    rest = s3.list_objects_v2(Bucket="alias-tiny-pool", Prefix=prefix, ContinuationToken=first["NextContinuationToken"])
    assert [o["Key"] for o in first["Contents"] + rest["Contents"]] == keys and not rest["IsTruncated"]
    assert {o["Size"] for o in first["Contents"] + rest["Contents"]} == {out_size}

    v1 = s3.get_paginator("list_objects").paginate(Bucket="alias-tiny-pool", Prefix=prefix,
                                                   PaginationConfig={"PageSize": 500})
    pages = [[o["Key"] for o in p["Contents"]] for p in v1]
    assert [len(p) for p in pages] == [100, 3] and sum(pages, []) == keys
    # Each output was computed once: the v1 listing found every one in the cache.
    assert metric(admin, "tensorgate_cache_misses_total") == misses + 103
    # The alias's bucket is shared with other tests: leave it as it was.
    s3.delete_objects(Bucket="alias-target", Delete={"Objects": [{"Key": k} for k in keys]})
