"""Alias endpoints (`[[pushdown.alias_endpoints]]`, ADR 0029): a listener per alias, whose object
reads are pushdowns of the same bucket and key, so a request is signed exactly as a plain read of
the real bucket is. The readers users bring (boto3, the aws CLI, pyarrow, Polars, Hugging Face
`datasets` on Parquet files and WebDataset shards, s3torchconnector) read features through one
with nothing but an endpoint URL, in
both identity modes; in transparent mode with each user's own store keys, and a user the store
refuses gets the store's `403`, also when another user's read of the same object is cached.
Runs against the store TENSORGATE_TEST_STORE names (scripts/test.sh runs it on SeaweedFS, Ceph
RGW and Swift), each with two users made by its script."""

import contextlib
import io
import itertools
import json
import os
import subprocess
import time

import botocore.exceptions
import numpy as np
import pytest

from conftest import STORE_KIND, free_port, free_ports, metric, run_gateway
from test_parquet import hf_table, jpeg, parquet_bytes
from test_identity import answer, client
from test_pushdown import pushdown_get, reference, reference_preprocess, rel_l2, tar_of

pytestmark = pytest.mark.skipif(STORE_KIND == "fs", reason="the embedded backend has no users of its own")

MODEL, SPLIT = "tiny-cnn", "pool"
_names = itertools.count()


@contextlib.contextmanager
def gateway_with_endpoints(store, logdir, mode: str, extra: str = "", ports=None):
    """A gateway in `mode` with four alias endpoints: `npy` (tiny-cnn at pool, the default
    format), `parquet` (the same as a Parquet file), `tar` (a shard as a WebDataset shard of
    `.npy` features) and `stem` (tiny-cnn at its first, spatial split: outputs larger than their
    sources). Transparent: the store authenticates
    its users, and the gateway's own key reads only what the store let a caller read.
    Terminating: the development client key, the store's main user's key. Yields (S3 endpoint,
    admin, {name: endpoint}, (access key, secret key) a client signs with)."""
    # Six distinct ports (the S3 and admin ones too, unless given): two free_port() calls may
    # name one port twice, and the gateway refuses to listen twice (exit 64).
    *named, s3_port, admin_port = free_ports(6, taken=ports or ())
    endpoints = dict(zip(("npy", "parquet", "tar", "stem"), named))
    ports = ports or (s3_port, admin_port)
    config = "".join(
        f'[[pushdown.alias_endpoints]]\nlisten = "127.0.0.1:{port}"\nmodel = "{MODEL}"\n'
        + (f'split = "{SPLIT}"\n' if name != "stem" else 'split = "stem"\n')
        + (f'format = "{name}"\n' if name in ("parquet", "tar") else "")
        for name, port in endpoints.items()
    ) + extra
    env = {"TENSORGATE_BACKEND_ENDPOINT": store["endpoint"], "TENSORGATE_BACKEND_ACCESS_KEY": store["access_key"],
           "TENSORGATE_BACKEND_SECRET_KEY": store["secret_key"], "TENSORGATE_BACKEND_IDENTITY": mode}
    if mode == "terminating":
        env.update(TENSORGATE_ACCESS_KEY="tensorgate-dev", TENSORGATE_SECRET_KEY="tensorgate-dev-secret")
        keys = ("tensorgate-dev", "tensorgate-dev-secret")
    else:
        keys = (store["access_key"], store["secret_key"])
    with run_gateway(logdir, config, env=env, ports=ports) as (endpoint, admin, _, _):
        yield endpoint, admin, {n: f"http://127.0.0.1:{p}" for n, p in endpoints.items()}, keys


@pytest.fixture(scope="module", params=["transparent", "terminating"])
def gw(request, store, tmp_path_factory):
    with gateway_with_endpoints(store, tmp_path_factory.mktemp(f"gw-{request.param}"), request.param) as g:
        yield request.param, *g


@pytest.fixture(scope="module")
def dataset(store):
    """A bucket of the store's main user (made directly, B has no grant) with images, a
    WebDataset shard and a Parquet file in Hugging Face's layout (30 rows, 3 row groups)."""
    a = client(store["endpoint"], store["access_key"], store["secret_key"])
    bucket = f"ep-{STORE_KIND}-{os.getpid()}-{next(_names)}"
    a.create_bucket(Bucket=bucket)
    images = {f"img/{i}.jpg": jpeg(7000 + i, (64, 48)) for i in range(6)}
    for key, data in images.items():
        a.put_object(Bucket=bucket, Key=key, Body=data)
    shard = tar_of([(f"s{i}.jpg", jpeg(7100 + i, (56, 72))) for i in range(4)])
    a.put_object(Bucket=bucket, Key="shard/000.tar", Body=shard)
    rows = [jpeg(7200 + i, (64, 48)) for i in range(30)]
    hf = {"info": {"features": {"image": {"_type": "Image"},
                                "label": {"names": ["a", "b", "c"], "_type": "ClassLabel"},
                                "caption": {"dtype": "string", "_type": "Value"}}}}
    table = hf_table(rows, [i % 3 for i in range(30)]).replace_schema_metadata({"huggingface": json.dumps(hf)})
    a.put_object(Bucket=bucket, Key="table/train-00000-of-00001.parquet", Body=parquet_bytes(table, row_group_size=12))
    return bucket, images, table, rows


def features_of(jpegs: list[bytes]) -> np.ndarray:
    """The independent reference: PIL + numpy preprocessing, Python onnxruntime."""
    from PIL import Image

    x = np.stack([reference_preprocess(Image.open(io.BytesIO(b)), MODEL) for b in jpegs]).astype(np.float32)
    return reference(MODEL, SPLIT, x)


def test_boto3_and_the_aws_cli_read_features_first_by_head_as_with_query_fields(gw, dataset, tmp_path):
    """An object nobody computed yet, read as the aws CLI reads (`HEAD`, then `GET`): the first
    `HEAD` already reports the output's size and ETag; the bytes equal the same request with
    fields on the S3 port, and the reference. A shard gives its samples' batch the same way."""
    mode, endpoint, admin, eps, (ak, sk) = gw
    bucket, images, _, _ = dataset
    a = client(eps["npy"], ak, sk)
    key = "img/0.jpg" if mode == "transparent" else "img/1.jpg"
    misses = metric(admin, "tensorgate_cache_misses_total")
    head = a.head_object(Bucket=bucket, Key=key)
    got = a.get_object(Bucket=bucket, Key=key)
    body = got["Body"].read()
    assert (head["ContentLength"], head["ETag"]) == (len(body), got["ETag"])
    assert head["ContentType"] == "application/x-npy"
    assert metric(admin, "tensorgate_cache_misses_total") == misses + 1, "computed once, by the HEAD"
    fields = pushdown_get(client(endpoint, ak, sk), bucket, key, model=MODEL, split=SPLIT)
    assert fields["Body"].read() == body
    feats = np.load(io.BytesIO(body), allow_pickle=False)
    assert rel_l2(feats, features_of([images[key]])) <= 1e-3  # JPEG decoders differ slightly

    # The aws CLI, as a user runs it: `HEAD` first (for the size), then the `GET`.
    cli_key = "img/2.jpg" if mode == "transparent" else "img/3.jpg"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=ak, AWS_SECRET_ACCESS_KEY=sk, AWS_DEFAULT_REGION="us-east-1",
               AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null")
    out = tmp_path / "features.npy"
    subprocess.run(["aws", "s3", "cp", f"s3://{bucket}/{cli_key}", str(out), "--endpoint-url", eps["npy"]],
                   env=env, check=True, capture_output=True)
    want = pushdown_get(client(endpoint, ak, sk), bucket, cli_key, model=MODEL, split=SPLIT)["Body"].read()
    assert out.read_bytes() == want

    shard = a.get_object(Bucket=bucket, Key="shard/000.tar")["Body"].read()
    assert shard == pushdown_get(client(endpoint, ak, sk), bucket, "shard/000.tar", model=MODEL,
                                 split=SPLIT)["Body"].read()


def test_parquet_readers_read_a_file_nobody_computed_yet(gw, dataset, tmp_path, monkeypatch):
    """pyarrow (`read_table`), Polars and Hugging Face `datasets` with their defaults, pointed
    at the Parquet alias endpoint: each gets the output file (every column but the image, the
    features added), each row group computed once however many ranges and readers ask."""
    import pyarrow as pa
    import pyarrow.fs
    import pyarrow.parquet as pq
    import polars as pl

    mode, endpoint, admin, eps, (ak, sk) = gw
    bucket, _, source, rows = dataset
    key = "table/train-00000-of-00001.parquet"
    want = features_of(rows).reshape(len(rows), -1)

    def check(table: pa.Table, reader: str):
        assert table.column_names == ["label", "caption", "features"], reader
        assert table.column("label").to_pylist() == source.column("label").to_pylist(), reader
        got = np.array(table.column("features").to_pylist(), dtype=np.float32)
        assert got.shape == want.shape, reader
        assert rel_l2(got, want) <= 1e-3, reader

    misses = metric(admin, "tensorgate_cache_misses_total")
    fs = pyarrow.fs.S3FileSystem(access_key=ak, secret_key=sk, endpoint_override=eps["parquet"],
                                 region="us-east-1", scheme="http")
    check(pq.read_table(f"{bucket}/{key}", filesystem=fs), "pyarrow")
    options = {"aws_access_key_id": ak, "aws_secret_access_key": sk, "aws_endpoint_url": eps["parquet"],
               "aws_region": "us-east-1", "aws_allow_http": "true"}
    check(pl.read_parquet(f"s3://{bucket}/{key}", storage_options=options).to_arrow(), "polars")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import datasets

    ds = datasets.load_dataset(
        "parquet", data_files=f"s3://{bucket}/{key}", split="train",
        storage_options={"key": ak, "secret": sk,
                         "client_kwargs": {"endpoint_url": eps["parquet"], "region_name": "us-east-1"}},
        cache_dir=str(tmp_path / "hf-cache"))
    check(ds.data.table, "datasets")
    if mode == "terminating":
        # The gateway verified the caller: a listing reports each output's size, so a reader
        # that sizes files from it (pyarrow.dataset) reads a directory too.
        import pyarrow.dataset as pads

        listed = client(eps["parquet"], ak, sk).list_objects_v2(Bucket=bucket, Prefix="table/")["Contents"]
        head = client(eps["parquet"], ak, sk).head_object(Bucket=bucket, Key=key)
        assert [(o["Key"], o["Size"], o["ETag"]) for o in listed] == [(key, head["ContentLength"], head["ETag"])]
        check(pads.dataset(f"{bucket}/table/", filesystem=fs, format="parquet").to_table(), "pyarrow dataset")
    assert metric(admin, "tensorgate_cache_misses_total") == misses + 3, "one computation per row group"


def test_a_first_read_of_a_large_file_computes_only_what_it_reads(gw, store, tmp_path, monkeypatch):
    """A 2,000-row image file nobody computed, read as pyarrow reads it with its defaults: the
    `HEAD` and the footer are answered from the source's footer alone (nothing computed, so
    their time does not grow with the file's rows), a row group's read computes that group
    alone, and `read_table` then gets every row's features, equal to the reference;
    `pyarrow.dataset`, Polars and `datasets` read the same."""
    import pyarrow.fs
    import pyarrow.parquet as pq

    mode, _, admin, eps, (ak, sk) = gw
    a = client(store["endpoint"], store["access_key"], store["secret_key"])
    bucket = f"ep-large-{STORE_KIND}-{os.getpid()}-{next(_names)}"
    a.create_bucket(Bucket=bucket)
    rows = [jpeg(20000 + i, (48 + i % 7, 44 + i % 5)) for i in range(2000)]
    table = hf_table(rows, [i % 10 for i in range(2000)])
    a.put_object(Bucket=bucket, Key="large.parquet", Body=parquet_bytes(table, row_group_size=100))
    samples = 'tensorgate_pushdown_samples_total{model="tiny-cnn",split="pool"}'
    before = (metric(admin, "tensorgate_cache_misses_total"), metric(admin, samples))

    head = client(eps["parquet"], ak, sk).head_object(Bucket=bucket, Key="large.parquet")
    fs = pyarrow.fs.S3FileSystem(access_key=ak, secret_key=sk, endpoint_override=eps["parquet"],
                                 region="us-east-1", scheme="http")
    with fs.open_input_file(f"{bucket}/large.parquet") as f:
        assert f.size() == head["ContentLength"]
        meta = pq.ParquetFile(f).metadata
        assert (meta.num_rows, meta.num_row_groups) == (2000, 20)
        assert json.loads(meta.metadata[b"tensorgate"])["split"] == SPLIT
        assert (metric(admin, "tensorgate_cache_misses_total"), metric(admin, samples)) == before, \
            "the HEAD and the footer computed nothing"
        group = pq.ParquetFile(f).read_row_group(7)
    got = np.array(group.column("features").to_pylist(), dtype=np.float32)
    assert rel_l2(got, features_of(rows[700:800]).reshape(100, -1)) <= 1e-3
    assert (metric(admin, "tensorgate_cache_misses_total"), metric(admin, samples)) == (before[0] + 1, before[1] + 100)

    whole = pq.read_table(f"{bucket}/large.parquet", filesystem=fs)
    assert whole.num_rows == 2000 and whole.column("label").to_pylist() == table.column("label").to_pylist()
    got = np.array(whole.column("features").to_pylist(), dtype=np.float32)
    assert rel_l2(got, features_of(rows).reshape(2000, -1)) <= 1e-3
    assert metric(admin, samples) == before[1] + 2000, "every row computed once"

    # The other readers, with their defaults, on the same file: served from the groups computed.
    import polars as pl
    import pyarrow.dataset as pads

    def same(t, reader: str):
        assert t.column("label").to_pylist() == table.column("label").to_pylist(), reader
        assert np.array_equal(np.array(t.column("features").to_pylist(), dtype=np.float32), got), reader

    same(pads.dataset(f"{bucket}/large.parquet", filesystem=fs, format="parquet").to_table(), "pyarrow dataset")
    options = {"aws_access_key_id": ak, "aws_secret_access_key": sk, "aws_endpoint_url": eps["parquet"],
               "aws_region": "us-east-1", "aws_allow_http": "true"}
    same(pl.read_parquet(f"s3://{bucket}/large.parquet", storage_options=options).to_arrow(), "polars")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import datasets

    ds = datasets.load_dataset(
        "parquet", data_files=f"s3://{bucket}/large.parquet", split="train",
        storage_options={"key": ak, "secret": sk,
                         "client_kwargs": {"endpoint_url": eps["parquet"], "region_name": "us-east-1"}},
        cache_dir=str(tmp_path / "hf-cache"))
    same(ds.data.table, "datasets")
    assert metric(admin, samples) == before[1] + 2000


def test_a_reader_that_goes_away_mid_file_leaves_what_it_asked_for_computed(gw, store):
    """A client that reads a file's first bytes and hangs up: the row groups it asked for are
    computed into the cache all the same, so its retry is served, not computed again."""
    import urllib.request

    import pyarrow.parquet as pq

    mode, _, admin, eps, (ak, sk) = gw
    a = client(store["endpoint"], store["access_key"], store["secret_key"])
    bucket = f"ep-gone-{STORE_KIND}-{os.getpid()}-{next(_names)}"
    a.create_bucket(Bucket=bucket)
    rows = [jpeg(30000 + i, (48, 44)) for i in range(250)]
    a.put_object(Bucket=bucket, Key="f.parquet", Body=parquet_bytes(hf_table(rows, [0] * 250), row_group_size=50))
    misses = metric(admin, "tensorgate_cache_misses_total")
    url = client(eps["parquet"], ak, sk).generate_presigned_url(
        "get_object", Params={"Bucket": bucket, "Key": "f.parquet"})
    with urllib.request.urlopen(url) as r:
        assert r.read(4) == b"PAR1"
    deadline = time.monotonic() + 120
    while metric(admin, "tensorgate_cache_misses_total") < misses + 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(admin, "tensorgate_cache_misses_total") == misses + 5, "every row group computed"
    body = client(eps["parquet"], ak, sk).get_object(Bucket=bucket, Key="f.parquet")["Body"].read()
    assert pq.read_table(io.BytesIO(body)).num_rows == 250
    assert metric(admin, "tensorgate_cache_misses_total") == misses + 5, "the retry computed nothing"


def test_datasets_reads_a_webdataset_shard_of_features_nobody_computed_yet(gw, dataset, tmp_path, monkeypatch):
    """Hugging Face `datasets`' WebDataset loader, pointed at the `tar` endpoint: the shard's
    samples come back as `.npy` features (numpy arrays), equal to the reference, keys kept."""
    mode, _, admin, eps, (ak, sk) = gw
    bucket, _, _, _ = dataset
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    import datasets

    misses = metric(admin, "tensorgate_cache_misses_total")
    ds = datasets.load_dataset(
        "webdataset", data_files=f"s3://{bucket}/shard/000.tar", split="train",
        storage_options={"key": ak, "secret": sk,
                         "client_kwargs": {"endpoint_url": eps["tar"], "region_name": "us-east-1"}},
        cache_dir=str(tmp_path / "hf-cache"))
    assert [r["__key__"] for r in ds] == [f"s{i}" for i in range(4)]
    want = features_of([jpeg(7100 + i, (56, 72)) for i in range(4)])
    got = np.stack([np.asarray(r["npy"], dtype=np.float32) for r in ds])
    assert rel_l2(got.reshape(want.shape), want) <= 1e-3
    assert metric(admin, "tensorgate_cache_misses_total") == misses + 1


def test_a_large_shard_is_sized_before_it_is_computed_and_a_reader_gone_leaves_it_computed(gw, store):
    """A WebDataset shard of 600 images nobody computed: a `HEAD` through the `tar` and the
    default-format endpoint (safetensors for a shard) reports each output's size from the shard's
    parse alone (nothing computed); a
    client that reads the first bytes of the `tar` output and hangs up leaves it computed into
    the cache (streamed to it while computed when that takes over a second), so the retry is
    served whole with one computation; every byte as the `HEAD` said, keys and labels kept,
    the features equal to the reference."""
    import tarfile
    import urllib.request

    mode, _, admin, eps, (ak, sk) = gw
    a = client(store["endpoint"], store["access_key"], store["secret_key"])
    bucket = f"ep-shard-{STORE_KIND}-{os.getpid()}-{next(_names)}"
    a.create_bucket(Bucket=bucket)
    jpegs = [jpeg(40000 + i, (64 + i % 5, 48)) for i in range(600)]
    members = [(f"s{i:04d}.{ext}", data) for i, j in enumerate(jpegs)
               for ext, data in (("jpg", j), ("cls", str(i % 5).encode()))]
    a.put_object(Bucket=bucket, Key="big.tar", Body=tar_of(members))
    samples = 'tensorgate_pushdown_samples_total{model="tiny-cnn",split="pool"}'
    before = (metric(admin, "tensorgate_cache_misses_total"), metric(admin, samples))

    heads = {name: client(eps[name], ak, sk).head_object(Bucket=bucket, Key="big.tar") for name in ("tar", "npy")}
    assert (metric(admin, "tensorgate_cache_misses_total"), metric(admin, samples)) == before, \
        "the HEADs computed nothing"
    want = features_of(jpegs)

    url = client(eps["tar"], ak, sk).generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "big.tar"})
    with urllib.request.urlopen(url) as r:
        assert r.headers["ETag"] == heads["tar"]["ETag"]
        assert int(r.headers["Content-Length"]) == heads["tar"]["ContentLength"]
        assert len(r.read(512)) == 512
    deadline = time.monotonic() + 120
    while metric(admin, "tensorgate_cache_misses_total") < before[0] + 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    got = client(eps["tar"], ak, sk).get_object(Bucket=bucket, Key="big.tar")
    assert got["ResponseMetadata"]["HTTPHeaders"]["x-tensorgate-cache"] in ("hit", "revalidated")
    assert (got["ContentLength"], got["ETag"]) == (heads["tar"]["ContentLength"], heads["tar"]["ETag"])
    assert (metric(admin, "tensorgate_cache_misses_total"), metric(admin, samples)) == (before[0] + 1, before[1] + 600)
    out = {}
    with tarfile.open(fileobj=io.BytesIO(got["Body"].read())) as t:
        for m in t.getmembers():
            out[m.name] = t.extractfile(m).read()
    assert list(out) == [n for i in range(600) for n in (f"s{i:04d}.npy", f"s{i:04d}.cls")]
    assert all(out[f"s{i:04d}.cls"] == str(i % 5).encode() for i in range(600))
    feats = np.stack([np.load(io.BytesIO(out[f"s{i:04d}.npy"])) for i in range(600)])
    assert rel_l2(feats.reshape(want.shape), want) <= 1e-3

    from safetensors.numpy import load

    got = client(eps["npy"], ak, sk).get_object(Bucket=bucket, Key="big.tar")
    body = got["Body"].read()
    assert len(body) == heads["npy"]["ContentLength"] and got["ETag"] == heads["npy"]["ETag"]
    tensors = load(body)
    assert tensors["labels"].tolist() == [i % 5 for i in range(600)]
    assert rel_l2(tensors["features"].reshape(want.shape), want) <= 1e-3


def test_s3torchconnector_reads_features_through_the_endpoint(gw, dataset, monkeypatch):
    """The AWS CRT-based PyTorch loader, given the endpoint: a prefix's objects as features."""
    from s3torchconnector import S3ClientConfig, S3MapDataset

    mode, _, _, eps, (ak, sk) = gw
    bucket, images, _, _ = dataset
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ak)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", sk)
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    got = S3MapDataset.from_prefix(f"s3://{bucket}/img/", region="us-east-1", endpoint=eps["npy"],
                                   s3client_config=S3ClientConfig(force_path_style=True),
                                   transform=lambda r: (r.key, r.read()))
    assert len(got) == len(images)
    keys = sorted(images)
    want = features_of([images[k] for k in keys])
    for i in range(len(got)):
        key, body = got[i]
        feats = np.load(io.BytesIO(body), allow_pickle=False)
        assert rel_l2(feats, want[keys.index(key)][None]) <= 1e-3, key


def test_ranged_downloads_of_an_output_larger_than_its_source_read_past_the_sources_end(gw, dataset, store, tmp_path):
    """boto3's `download_file` of an output many times its source's size, in parts whose `Range`
    and `If-Match` (the `HEAD`'s ETag, the output's) it signs: a range past the source's end is
    still the output's, and `If-Match` names the output (in transparent mode the store's `416`
    or `412` to the caller's own range or condition is its yes: stores authorize first); a
    Parquet output downloads the same way; the other user gets the store's refusal."""
    from boto3.s3.transfer import TransferConfig

    mode, endpoint, admin, eps, (ak, sk) = gw
    bucket, images, _, _ = dataset
    want = pushdown_get(client(endpoint, ak, sk), bucket, "img/5.jpg", model=MODEL, split="stem")["Body"].read()
    assert len(want) > 4 * len(images["img/5.jpg"])
    out = tmp_path / "stem.npy"
    chunks = TransferConfig(multipart_threshold=1024, multipart_chunksize=len(want) // 3 + 1, max_concurrency=1)
    client(eps["stem"], ak, sk).download_file(bucket, "img/5.jpg", str(out), Config=chunks)
    assert out.read_bytes() == want
    past = f"bytes={len(images['img/5.jpg']) + 100}-{len(images['img/5.jpg']) + 199}"
    got = client(eps["stem"], ak, sk).get_object(Bucket=bucket, Key="img/5.jpg", Range=past)
    assert got["Body"].read() == want[len(images["img/5.jpg"]) + 100:len(images["img/5.jpg"]) + 200]
    etag = client(eps["stem"], ak, sk).head_object(Bucket=bucket, Key="img/5.jpg")["ETag"]
    with pytest.raises(botocore.exceptions.ClientError) as failed:
        client(eps["stem"], ak, sk).get_object(Bucket=bucket, Key="img/5.jpg", IfMatch='"another"')
    assert failed.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    key = "table/train-00000-of-00001.parquet"
    table_want = client(eps["parquet"], ak, sk).get_object(Bucket=bucket, Key=key)["Body"].read()
    chunks = TransferConfig(multipart_threshold=1024, multipart_chunksize=len(table_want) // 3 + 1, max_concurrency=1)
    client(eps["parquet"], ak, sk).download_file(bucket, key, str(tmp_path / "t.parquet"), Config=chunks)
    assert (tmp_path / "t.parquet").read_bytes() == table_want
    if mode == "transparent":
        b = client(eps["stem"], store["alt_access_key"], store["alt_secret_key"])
        for condition in ({"Range": past}, {"IfMatch": etag}, {"IfMatch": etag, "Range": past}):
            with pytest.raises(botocore.exceptions.ClientError) as refused:
                b.get_object(Bucket=bucket, Key="img/5.jpg", **condition)
            assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] in (403, 404), condition


def test_an_endpoint_is_read_only_and_names_its_own_model(gw, dataset):
    """Writes are refused (`405`); a read naming a model or split too is a `400`; a listing is the
    store's listing of the same bucket; the S3 port still serves plain reads."""
    mode, endpoint, _, eps, (ak, sk) = gw
    bucket, images, _, _ = dataset
    a = client(eps["npy"], ak, sk)
    assert answer(lambda: a.put_object(Bucket=bucket, Key="new.jpg", Body=b"x"))[1] == "MethodNotAllowed"
    assert answer(lambda: a.delete_object(Bucket=bucket, Key="img/0.jpg"))[1] == "MethodNotAllowed"
    assert answer(lambda: pushdown_get(a, bucket, "img/0.jpg", model=MODEL, split="stem"))[1] == "InvalidArgument"
    listed = a.list_objects_v2(Bucket=bucket, Prefix="img/")["Contents"]
    assert [o["Key"] for o in listed] == sorted(images)
    plain = client(endpoint, ak, sk).get_object(Bucket=bucket, Key="img/0.jpg")["Body"].read()
    assert plain == images["img/0.jpg"]


def test_another_user_gets_what_the_store_answers_cached_or_not(gw, dataset, store):
    """Transparent mode: user B, without a grant on A's bucket, gets on the endpoints exactly
    what the store answers B directly (`403`; `404` on Swift, where B's account has no such
    bucket), for an output A's reads cached and for one nobody computed; nothing is computed for
    B and the gateway's own key never reads for B."""
    mode, _, admin, eps, (ak, sk) = gw
    if mode != "transparent":
        pytest.skip("the store's users sign only in transparent mode (terminating: the gateway's clients)")
    bucket, _, _, _ = dataset
    alt = (store["alt_access_key"], store["alt_secret_key"])
    a, b, b_direct = client(eps["npy"], ak, sk), client(eps["npy"], *alt), client(store["endpoint"], *alt)
    a.get_object(Bucket=bucket, Key="img/4.jpg")["Body"].read()  # cached now
    misses = metric(admin, "tensorgate_cache_misses_total")
    refused = answer(lambda: b_direct.get_object(Bucket=bucket, Key="img/4.jpg"))[1]
    assert refused in ("AccessDenied", "NoSuchBucket")
    head_status = answer(lambda: b_direct.head_object(Bucket=bucket, Key="img/4.jpg"))[0]
    for key in ("img/4.jpg", "img/5.jpg"):
        assert answer(lambda: b.get_object(Bucket=bucket, Key=key))[1] == refused, key
        assert answer(lambda: b.head_object(Bucket=bucket, Key=key))[0] == head_status, key
    bp = client(eps["parquet"], *alt)
    assert answer(lambda: bp.get_object(Bucket=bucket, Key="table/train-00000-of-00001.parquet"))[1] == refused
    assert metric(admin, "tensorgate_cache_misses_total") == misses, "nothing computed for B"


def test_a_transparent_cluster_computes_an_endpoints_reads_at_each_objects_owner(store, dataset, tmp_path):
    """Two transparent members with the same endpoints: a read through either member's endpoint
    (a `HEAD` first, as the aws CLI reads) is computed by the object's owner, which gets the
    caller's own request with the endpoint's fields beside it, and reads the source there."""
    from tensorgate.cluster import rank
    from test_cluster import cluster_config, wait_states

    bucket, images, _, _ = dataset
    # The bucket's name differs per run, so the members' names are chosen to spread its keys
    # over both (six keys all on one of two members happens once in 32 names).
    ids = next(ids for n in range(64) for ids in [[f"ep{n}-{i}" for i in range(2)]]
               if len({rank(ids, bucket, k)[0] for k in images}) == 2)
    members = [{"id": i, "s3": f"http://127.0.0.1:{free_port()}", "admin": f"http://127.0.0.1:{free_port()}"}
               for i in ids]
    with contextlib.ExitStack() as stack:
        gws = []
        for m in members:
            ports = (int(m["s3"].rsplit(":", 1)[1]), int(m["admin"].rsplit(":", 1)[1]))
            gws.append(stack.enter_context(gateway_with_endpoints(
                store, tmp_path, "transparent", cluster_config(m["id"], members), ports)))
        wait_states([m["admin"] for m in members], ["ready"] * 2)
        owners = {k: rank([m["id"] for m in members], bucket, k)[0] for k in images}
        assert len(set(owners.values())) == 2, "the keys spread over both members"
        for key, owner in owners.items():
            for _, _, eps, (ak, sk) in gws:
                a = client(eps["npy"], ak, sk)
                head = a.head_object(Bucket=bucket, Key=key)
                got = a.get_object(Bucket=bucket, Key=key)
                assert got["ResponseMetadata"]["HTTPHeaders"]["x-tensorgate-computed-by"] == owner, key
                body = got["Body"].read()
                assert head["ContentLength"] == len(body)
                assert rel_l2(np.load(io.BytesIO(body)), features_of([images[key]])) <= 1e-3, key


def test_without_a_gateway_key_a_first_head_is_refused_clearly(store, tmp_path):
    """Transparent mode without `backend.access_key`: the gateway cannot read what a caller's
    `HEAD` did not, so a first `HEAD` of an output not cached is a clear `400` naming the key."""
    ep = free_port()
    config = f'[[pushdown.alias_endpoints]]\nlisten = "127.0.0.1:{ep}"\nmodel = "{MODEL}"\nsplit = "{SPLIT}"\n'
    with run_gateway(tmp_path, config, env={"TENSORGATE_BACKEND_ENDPOINT": store["endpoint"]}):
        a_direct = client(store["endpoint"], store["access_key"], store["secret_key"])
        bucket = f"ep-nokey-{STORE_KIND}-{os.getpid()}-{next(_names)}"
        a_direct.create_bucket(Bucket=bucket)
        a_direct.put_object(Bucket=bucket, Key="x.jpg", Body=jpeg(7300))
        a = client(f"http://127.0.0.1:{ep}", store["access_key"], store["secret_key"])
        with pytest.raises(botocore.exceptions.ClientError) as e:
            a.head_object(Bucket=bucket, Key="x.jpg")
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
        body = a.get_object(Bucket=bucket, Key="x.jpg")["Body"].read()
        assert a.head_object(Bucket=bucket, Key="x.jpg")["ContentLength"] == len(body)


@pytest.mark.skipif(STORE_KIND != "seaweedfs", reason="the README's example names a SeaweedFS")
def test_the_readme_alias_endpoint_example_runs_as_written(tmp_path, monkeypatch):
    """The README's alias endpoint example, verbatim (its `features.toml`, the `serve` command,
    the aws CLI command and the Python readers), in front of a SeaweedFS at the address it names:
    user A's reads give the features; user B's the store's refusal."""
    import re
    import shlex

    from conftest import BINARY, ROOT, ort_library, wait_ready

    section = (ROOT / "README.md").read_text().split("## Features through nothing but an endpoint URL")[1]
    section = section.split("\n## ")[0]
    toml = re.search(r"```toml\n(.*?)```", section, re.S).group(1)
    serve, cp = re.findall(r"```sh\n(.*?)\n```", section, re.S)
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    (tmp_path / "features.toml").write_text(toml)
    (tmp_path / "store.secret").write_text("seaweed-sk\n")
    env = dict(os.environ, SEAWEED_PORT="8333")
    subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "start"], env=env, check=True, capture_output=True)
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORGATE_", "AWS_", "ORT_"))}
    run_env["PATH"] = f"{BINARY.parent}:{run_env['PATH']}"
    # Run from another directory than the checkout: where ONNX Runtime and the models are.
    serve_env = dict(run_env, TENSORGATE_ORT_LIBRARY=ort_library(), TENSORGATE_MODELS_DIR=str(ROOT / "models"))
    proc = subprocess.Popen(shlex.split(serve), cwd=tmp_path, env=serve_env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready("http://127.0.0.1:9001", proc)
        a = client("http://127.0.0.1:8333", "seaweed-ak", "seaweed-sk")
        with contextlib.suppress(botocore.exceptions.ClientError):
            a.create_bucket(Bucket="photos")
        cat = jpeg(7400, (80, 60))
        rows = [jpeg(7500 + i, (64, 48)) for i in range(8)]
        a.put_object(Bucket="photos", Key="cat.jpg", Body=cat)
        a.put_object(Bucket="photos", Key="train.parquet", Body=parquet_bytes(hf_table(rows, [0] * 8)))

        def user(ak, sk):
            return dict(run_env, AWS_ACCESS_KEY_ID=ak, AWS_SECRET_ACCESS_KEY=sk, AWS_REGION="us-east-1",
                        AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null")

        done = subprocess.run(shlex.split(cp), cwd=tmp_path, env=user("seaweed-ak", "seaweed-sk"),
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        feats = np.load(tmp_path / "cat.npy", allow_pickle=False)
        assert rel_l2(feats, features_of([cat])) <= 1e-3
        refused = subprocess.run(shlex.split(cp), cwd=tmp_path, env=user("seaweed-alt-ak", "seaweed-alt-sk"),
                                 capture_output=True, text=True)
        assert refused.returncode != 0 and "403" in refused.stderr, refused.stderr

        for k, v in user("seaweed-ak", "seaweed-sk").items():
            if k.startswith("AWS_"):
                monkeypatch.setenv(k, v)
        scope: dict = {}
        exec(compile(python, "README.md", "exec"), scope)
        want = features_of(rows).reshape(len(rows), -1)
        for table in (scope["table"], scope["frame"].to_arrow()):
            assert table.column_names == ["label", "caption", "features"]
            assert rel_l2(np.array(table.column("features").to_pylist(), dtype=np.float32), want) <= 1e-3
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "stop"], env=env, check=False)
