"""Parquet inputs (ADR 0016): a dataset file in the layout Hugging Face `datasets`
writes (an `image` struct of `bytes` and `path`, an integer `label`), pushed down as one request:
every row's features equal PIL + onnxruntime's, with the labels and keys beside them; bad files
get a clear 4xx and the gateway keeps serving."""

import io
import json
import sys

import botocore.exceptions
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from conftest import ROOT, metric
from test_pushdown import pushdown_get, reference, reference_preprocess, rel_l2, synthetic_photo


def jpeg(seed: int, size=(160, 120)) -> bytes:
    buf = io.BytesIO()
    synthetic_photo(*size, seed=seed).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def parquet_bytes(table: pa.Table, **kw) -> bytes:
    buf = io.BytesIO()
    pq.write_table(table, buf, **kw)
    return buf.getvalue()


def hf_table(images: list[bytes], labels: list[int], column: str = "image") -> pa.Table:
    """The columns `datasets` writes for an Image feature and a ClassLabel."""
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    cells = [{"bytes": b, "path": f"train/{i:05d}.jpg"} for i, b in enumerate(images)]
    return pa.table({column: pa.array(cells, type=image_type), "label": pa.array(labels, type=pa.int64()),
                     "caption": pa.array([f"picture {i}" for i in range(len(images))])})


def safetensors_of(raw: bytes) -> tuple[dict, dict]:
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = {"F32": np.float32, "I64": np.int64, "F16": np.float16}[info["dtype"]]
        out[name] = np.frombuffer(data[slice(*info["data_offsets"])], dtype=dtype).reshape(info["shape"])
    return out, header.get("__metadata__", {})


def test_a_dataset_file_of_three_row_groups_gives_every_rows_features_labels_and_keys(s3, bucket):
    """200 rows in 3 row groups (Snappy pages, pyarrow's default) through ResNet-18 at `pool`."""
    images = [jpeg(1000 + i) for i in range(200)]
    labels = [i % 10 for i in range(200)]
    data = parquet_bytes(hf_table(images, labels), row_group_size=67)
    assert pq.ParquetFile(io.BytesIO(data)).metadata.num_row_groups == 3
    s3.put_object(Bucket=bucket, Key="train-00000.parquet", Body=data)

    got = pushdown_get(s3, bucket, "train-00000.parquet", model="resnet18", split="pool")
    assert got["ContentType"] == "application/vnd.safetensors"
    tensors, meta = safetensors_of(got["Body"].read())
    assert json.loads(meta["keys"]) == [f"train/{i:05d}.jpg" for i in range(200)]
    assert tensors["labels"].tolist() == labels
    x = np.stack([reference_preprocess(Image.open(io.BytesIO(b)), "resnet18") for b in images]).astype(np.float32)
    want = np.concatenate([reference("resnet18", "pool", x[i : i + 50]) for i in range(0, 200, 50)])
    assert tensors["features"].shape == want.shape
    err = rel_l2(tensors["features"], want)
    print(f"Parquet, 200 rows: rel L2 {err:.2e}")
    assert err <= 1e-3  # JPEG: libjpeg-turbo's IDCT against PIL's, as for single JPEGs

    # Parquet out: every column but the image, byte for byte, the features added, in the
    # source's row groups, with `datasets`' feature description updated.
    got = pushdown_get(s3, bucket, "train-00000.parquet", model="resnet18", split="pool", format="parquet")
    assert got["ContentType"] == "application/vnd.apache.parquet"
    raw = got["Body"].read()
    out = pq.ParquetFile(io.BytesIO(raw))
    assert [out.metadata.row_group(i).num_rows for i in range(3)] == [67, 67, 66]
    table = out.read()
    source = hf_table(images, labels)
    assert table.column_names == ["label", "caption", "features"]
    assert table.select(["label", "caption"]).equals(source.select(["label", "caption"]))
    features = np.array(table.column("features").to_pylist(), dtype=np.float32)
    assert rel_l2(features, want.reshape(200, -1)) == pytest.approx(err, rel=1e-3, abs=1e-7)
    meta = table.schema.metadata
    assert json.loads(meta[b"tensorgate"]) == {"model": "resnet18", "split": "pool", "shape": list(want.shape[1:]),
                                               "dtype": "f32", "column": "image"}
    print(f"Parquet out: {len(raw) / 200:.0f} bytes per row, the source {len(data) / 200:.0f}")


def test_the_column_may_be_named_plain_binary_or_unlabelled_and_npy_stacks_the_rows(s3, bucket):
    images = [jpeg(2000 + i, (64, 48)) for i in range(5)]
    x = np.stack([reference_preprocess(Image.open(io.BytesIO(b)), "tiny-cnn") for b in images]).astype(np.float32)
    want = reference("tiny-cnn", "pool", x)
    # CIFAR-10's column is `img`; some datasets store bare bytes and no labels.
    s3.put_object(Bucket=bucket, Key="img.parquet", Body=parquet_bytes(hf_table(images, [1, 2, 3, 4, 5], "img")))
    s3.put_object(Bucket=bucket, Key="bare.parquet", Body=parquet_bytes(pa.table({"png": pa.array(images, pa.binary())})))
    for key, column in [("img.parquet", "img"), ("bare.parquet", "png")]:
        got = pushdown_get(s3, bucket, key, model="tiny-cnn", split="pool", column=column)
        tensors, meta = safetensors_of(got["Body"].read())
        assert rel_l2(tensors["features"], want) <= 1e-3
        assert ("labels" in tensors) == (key == "img.parquet")
        if key == "bare.parquet":
            assert json.loads(meta["keys"]) == ["0", "1", "2", "3", "4"]  # the row numbers
    npy = pushdown_get(s3, bucket, "img.parquet", model="tiny-cnn", split="pool", column="img", format="npy")
    assert rel_l2(np.load(io.BytesIO(npy["Body"].read())), want) <= 1e-3


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def hostile_schema(depth: int, leaves: int = 1) -> bytes:
    """A Parquet file whose schema nests `depth` groups with `leaves` binary columns in the
    innermost (its footer written by hand in Thrift's compact protocol, as no writer makes such
    a file)."""

    def zigzag(n):
        return varint((n << 1) ^ (n >> 63))

    def group(children):  # optional
        return b"\x35" + zigzag(1) + b"\x18\x01a" + b"\x15" + zigzag(children) + b"\x00"

    root = b"\x48" + varint(6) + b"schema" + b"\x15" + zigzag(1 if depth else leaves) + b"\x00"
    leaf = b"\x15" + zigzag(6) + b"\x25" + zigzag(1) + b"\x18\x01a" + b"\x00"  # optional BYTE_ARRAY
    groups = group(1) * (depth - 1) + group(leaves) if depth else b""
    schema = b"\x19\xfc" + varint(1 + depth + leaves) + root + groups + leaf * leaves
    meta = b"\x15" + zigzag(1) + schema + b"\x16" + zigzag(0) + b"\x19\x0c" + b"\x00"
    return b"PAR1" + meta + len(meta).to_bytes(4, "little") + b"PAR1"


def page_bomb() -> bytes:
    """A Parquet file (Snappy, pyarrow's default) whose one data page's header claims 128 MiB
    uncompressed, where its footer claims 1.1 MiB: the parquet crate sizes the page's
    decompression buffer by the header, so it must be refused before it is read. The header's
    size field is rewritten in place (same varint length), so every offset stays true."""
    value = np.random.default_rng(5).bytes(1_100_000)
    body = bytearray(parquet_bytes(pa.table({"image": pa.array([value], pa.binary())}), use_dictionary=False))
    at = pq.ParquetFile(io.BytesIO(bytes(body))).metadata.row_group(0).column(0).data_page_offset
    assert body[at : at + 3] == b"\x15\x00\x15", "a data page header: its type, then its uncompressed size"
    end = at + 3
    while body[end] & 0x80:
        end += 1
    claim = varint(2 * (2**27 - 1))  # Thrift's compact protocol: zigzag, then varint
    assert end + 1 - (at + 3) == len(claim), "the claim takes the place of the true size"
    body[at + 3 : end + 1] = claim
    return bytes(body)


def hostile_files() -> list[tuple[str, bytes, dict, int, str]]:
    """(key, body, pushdown fields, status, what the message names)."""
    images = [jpeg(3000 + i, (64, 48)) for i in range(3)]
    good = parquet_bytes(hf_table(images, [0, 1, 2]))
    footer_len = int.from_bytes(good[-8:-4], "little")
    damaged = bytearray(good)
    damaged[-8 - footer_len : -8 - footer_len + 64] = bytes(64)  # the footer's first bytes zeroed
    huge_footer = good[:-8] + (2**31).to_bytes(4, "little") + b"PAR1"
    many_rows = parquet_bytes(pa.table({"image": pa.array([b"x"] * 10_001, pa.binary())}))
    zstd = parquet_bytes(hf_table(images, [0, 1, 2]), compression="zstd")
    numbers = parquet_bytes(pa.table({"image": pa.array([1, 2, 3])}))
    null_image = parquet_bytes(pa.table({"image": pa.array([images[0], None], pa.binary())}))
    plain = pa.table({"image": pa.array(images, pa.binary())})
    delta = {e: parquet_bytes(plain, use_dictionary=False, column_encoding={"image": e})
             for e in ("DELTA_LENGTH_BYTE_ARRAY", "DELTA_BYTE_ARRAY")}
    return [
        ("missing-column.parquet", good, {"column": "pixels"}, 400, "its columns: image, label, caption"),
        ("numbers.parquet", numbers, {}, 400, "not encoded images"),
        ("damaged.parquet", bytes(damaged), {}, 400, "Parquet"),
        ("huge-footer.parquet", huge_footer, {}, 400, "footer claims"),
        ("many-rows.parquet", many_rows, {}, 400, "10001 rows"),
        ("no-rows.parquet", parquet_bytes(hf_table([], [])), {}, 400, "0 rows"),
        ("zstd.parquet", zstd, {}, 415, "Snappy"),
        ("null-image.parquet", null_image, {}, 400, "row 1"),
        # Page headers are read before any page: a size beyond the footer's claim, and the two
        # encodings whose values the parquet crate sizes from counts no header bounds.
        ("page-bomb.parquet", page_bomb(), {}, 400, "states 134217727 uncompressed bytes, more than"),
        ("delta-length.parquet", delta["DELTA_LENGTH_BYTE_ARRAY"], {}, 415, "is DELTA_LENGTH_BYTE_ARRAY encoded"),
        ("delta-byte-array.parquet", delta["DELTA_BYTE_ARRAY"], {}, 415, "is DELTA_BYTE_ARRAY encoded"),
        ("not-parquet.npy", b"\x93NUMPY" + bytes(100), {"column": "image"}, 400, "names a Parquet file's input column"),
        # Deeper than a schema may nest (the parquet crate builds and drops a schema recursively:
        # 30,000 levels aborted the gateway before the check), and wider.
        ("deep.parquet", hostile_schema(9_000), {}, 400, "nests deeper than 64 levels"),
        ("deeper.parquet", hostile_schema(30_000), {}, 400, "has 30002 elements"),
        ("wide.parquet", hostile_schema(1, 20_000), {}, 400, "has 20002 elements"),
        ("fine-schema.parquet", hostile_schema(3, 2), {}, 400, "no column"),
        # A Parquet output adds a `features` column; it is for Parquet sources, and has no bf16.
        ("has-features.parquet", parquet_bytes(hf_table(images, [0, 1, 2]).append_column("features", pa.array([1, 2, 3]))),
         {"format": "parquet"}, 400, "has a column \"features\" already"),
        ("not-a-table.npy", b"\x93NUMPY" + bytes(100), {"format": "parquet"}, 400, "parquet is for Parquet sources"),
        ("bf16.parquet", good, {"format": "parquet", "dtype": "bf16"}, 400, "no .npy or Parquet encoding"),
        # Row groups the file lacks; a bad range.
        ("one-group.parquet", good, {"row-groups": "1-2"}, 400, "has 1 row groups, numbered from 0"),
        ("backwards.parquet", good, {"row-groups": "2-1"}, 400, "row-groups"),
    ]


def assert_refused(s3, bucket, model: str, cases):
    """Each (key, body, pushdown fields, status, what the message names) stored, then pushed down
    through `model` at `pool`: refused with that status and message."""
    for key, body, fields, status, needle in cases:
        s3.put_object(Bucket=bucket, Key=key, Body=body)
        with pytest.raises(botocore.exceptions.ClientError) as e:
            pushdown_get(s3, bucket, key, model=model, split="pool", **fields)
        r = e.value.response
        assert r["ResponseMetadata"]["HTTPStatusCode"] == status, (key, r["Error"])
        assert needle in r["Error"]["Message"], (key, r["Error"])


def test_bad_parquet_files_get_a_clear_error_and_the_gateway_keeps_serving(s3, bucket):
    assert_refused(s3, bucket, "tiny-cnn", hostile_files())
    images = [jpeg(4000, (64, 48))]
    s3.put_object(Bucket=bucket, Key="after.parquet", Body=parquet_bytes(hf_table(images, [7])))
    got = pushdown_get(s3, bucket, "after.parquet", model="tiny-cnn", split="pool")
    tensors, _ = safetensors_of(got["Body"].read())
    assert tensors["labels"].tolist() == [7]


@pytest.mark.parametrize("row_groups", [False, True])
def test_the_python_client_streams_parquet_files_as_shards_to_ranks_and_workers(gateway, s3, bucket, row_groups):
    """`ShardDataset` over a prefix of Parquet files (listed with `.tar` shards' rules,
    counted from their footers by `write_index`): two ranks, two loader workers each, equal
    batch counts, every row once, the pushdown's features equal to the no-pushdown baseline
    (the raw files decoded here) and the labels and keys the files hold. With `row_groups`, each
    row group is a shard of its own: shuffled, assigned and fetched by row group."""
    from torch.utils.data import DataLoader

    from conftest import CLIENT_AK, CLIENT_SK
    from tensorgate import Client
    from tensorgate.data import ShardDataset
    from tensorgate.wds import write_index

    endpoint, admin, _ = gateway
    client = Client(endpoint, CLIENT_AK, CLIENT_SK, admin=admin)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    rows = {"hf/train-0.parquet": 7, "hf/train-1.parquet": 5, "hf/train-2.parquet": 6}
    labels = {}
    for f, (key, n) in enumerate(rows.items()):
        cells = [{"bytes": jpeg(6000 + 10 * f + i, (64, 48)), "path": f"{f}/{i}.jpg"} for i in range(n)]
        labels.update({c["path"]: (f + i) % 4 for i, c in enumerate(cells)})
        table = pa.table({"image": pa.array(cells, type=image_type),
                          "label": pa.array([(f + i) % 4 for i in range(n)], pa.int64())})
        s3.put_object(Bucket=bucket, Key=key, Body=parquet_bytes(table, row_group_size=3))
    s3.put_object(Bucket=bucket, Key="hf/README.md", Body=b"# a dataset card, not a shard\n")
    assert write_index(client, bucket, "hf/") == rows

    def epoch(split: str, workers: int) -> tuple[dict, list[int]]:
        feats, batches = {}, []
        for rank in range(2):
            ds = ShardDataset(client, bucket, "tiny-cnn", split, prefix="hf/", index="hf/shards.json", rank=rank,
                              world_size=2, batch_size=4, shuffle=True, seed=5, tensors="numpy",
                              row_groups=row_groups)
            if row_groups:
                # 7, 5 and 6 rows, 3 to a row group: 3 + 2 + 2 shards, in an order shuffled by group.
                sizes = {f"{k}#row-group={g}": min(3, n - 3 * g) for k, n in rows.items() for g in range(-(-n // 3))}
                assert len(sizes) == 7 and ds._shards()[1] == sizes
                order = [s.key for s in ds.slices(0)]
                assert all("#row-group=" in k for k in order)
            loader = DataLoader(ds, batch_size=None, num_workers=workers,
                                **({"multiprocessing_context": "spawn"} if workers else {}))
            n = 0
            for b in loader:
                n += 1
                for k, x, y in zip(b["key"], b["features"], b["label"]):
                    assert k not in feats, k
                    feats[k] = np.asarray(x)
                    assert int(y) == labels[k]
            batches.append(n)
        return feats, batches

    misses = metric(admin, "tensorgate_cache_misses_total")
    pushed, batches = epoch("stem", 2)
    if row_groups:  # one output per row group, each computed once
        assert metric(admin, "tensorgate_cache_misses_total") - misses == 7
    assert sorted(pushed) == sorted(labels)
    assert batches[0] == batches[1]
    baseline, _ = epoch("none", 0)
    keys = sorted(labels)
    assert rel_l2(np.stack([pushed[k] for k in keys]), np.stack([baseline[k] for k in keys])) <= 1e-3


@pytest.mark.parametrize("model", ["tiny-cnn", "minilm"])
def test_split_auto_profiles_parquet_files_and_the_loader_yields_what_the_plan_chose(gateway, s3, bucket, tmp_path,
                                                                                     monkeypatch, model):
    """`split="auto"` on Parquet files (images, and texts for a text encoder): the profile reads
    the first file's footer and first rows by ranges, counts its rows, times the baseline on
    them; the planner chooses among the profiled candidates (a text model's: the baseline and its
    freeze split), and every row comes out once with its label and the freeze split's features,
    equal to the no-pushdown baseline."""
    sys.path.insert(0, str(ROOT / "bench"))
    import dataset

    from conftest import CLIENT_AK, CLIENT_SK
    from tensorgate import Client, ShardLoader

    monkeypatch.setenv("TENSORGATE_CACHE_DIR", str(tmp_path))
    endpoint, admin, _ = gateway
    client = Client(endpoint, CLIENT_AK, CLIENT_SK, admin=admin)
    if model == "minilm":
        files = dataset.text_shards(dataset.sentences(40, classes=4, seed=7), per_shard=20, row_group=8)
    else:
        image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
        files = [parquet_bytes(pa.table({
            "image": pa.array([{"bytes": jpeg(7000 + 20 * f + i, (64, 48)), "path": f"{f}/{i}.jpg"} for i in range(20)],
                              type=image_type),
            "label": pa.array([(f + i) % 4 for i in range(20)], pa.int64())}), row_group_size=8) for f in range(2)]
    for f, body in enumerate(files):
        s3.put_object(Bucket=bucket, Key=f"auto/{f}.parquet", Body=body)

    def read(split: str) -> tuple[np.ndarray, list, ShardLoader]:
        """Features, (key, label) pairs, in the loader's order (files in order, rows in order;
        a text file's rows are keyed by row number, so keys repeat across files)."""
        loader = ShardLoader(client, bucket, "auto/", model, split, batch_size=8)
        feats, rows = [], []
        for x, y, keys in loader:
            feats.append(np.asarray(x, np.float32))
            rows += [(k, int(l)) for k, l in zip(keys, y)]
        return np.concatenate(feats), rows, loader

    auto, labels, loader = read("auto")
    plan = loader.plans[0]
    compute = plan["profile"]["compute_secs_per_sample"]
    info = client.models()[model]
    assert "none" in compute and compute["none"] > 0
    assert plan["profile"]["samples"] == 40  # rows from the footer x files
    # Each file is one request (`row_groups=True` would make each row group one): its 20 rows are
    # the unit the tiers pipeline.
    assert plan["profile"]["samples_per_request"] == plan["plan"]["samples_per_request"] == 20
    if model == "minilm":
        assert set(compute) <= {"none", info["freeze"]}
        # The storage node's costs were measured at these texts' length where its batches are cut
        # to their longest text (pooled outputs), at the model's for sequence outputs.
        tokens = plan["profile"]["tokens_per_sample"]
        assert 1 <= tokens < info["input_shape"][-1]
        measured = {s["split"]: s["text_length"] for s in plan["storage"]["splits"]}
        step = -(-int(np.ceil(tokens)) // 8) * 8
        assert measured[info["freeze"]] == step < info["input_shape"][-1]
        assert all(n == info["input_shape"][-1] for s, n in measured.items() if s.startswith("layer"))
    else:
        assert "tokens_per_sample" not in plan["profile"]
        assert all("text_length" not in s for s in plan["storage"]["splits"])
    assert plan["plan"]["chosen"] in compute
    print(model, "profiled", sorted(compute), "chose", plan["plan"]["chosen"])
    baseline, base_rows, _ = read("none")
    assert len(auto) == len(labels) == 40 and labels == base_rows
    assert rel_l2(auto, baseline) <= 1e-5
