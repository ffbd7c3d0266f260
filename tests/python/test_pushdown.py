"""Pushdown GET through the real gateway binary (SeaweedFS backend) against an independent
reference: Python onnxruntime running the full model with the split tensor exposed.

Inputs are .npy tensors, JPEG and PNG images in every mode PIL reads, and WebDataset shards."""

import io
import json
import urllib.error
import urllib.request

import botocore.exceptions
import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import ROOT

MODELS = {
    # name: (input name, per-sample shape, splits to check)
    "tiny-cnn": ("image", (3, 32, 32), ["stem", "block2", "pool"]),
    "pp-lcnet": ("x", (3, 224, 224), ["stem", "block3"]),
    "resnet50-thin": ("input:0", (224, 224, 3), ["stage0", "pool"]),
    "resnet18": ("input", (3, 224, 224), ["layer3", "pool"]),
    # A transformer (LayerNorm, attention, GELU), symbolic batch.
    "tiny-vit": ("image", (3, 32, 32), ["tokens", "block1", "pooled"]),
    # Weights in an external-data file beside the model.
    "tiny-cnn-ext": ("image", (3, 32, 32), ["block1", "pool"]),
}


def manifest_tensor(model: str, split: str) -> str:
    import tomllib

    m = tomllib.loads((ROOT / "models" / model / "manifest.toml").read_text())
    return next(s["tensor"] for s in m["splits"] if s["name"] == split)


def reference(model: str, split: str, x: np.ndarray) -> np.ndarray:
    m = onnx.load(str(ROOT / "models" / model / "model.onnx"))
    m.graph.output.append(onnx.helper.make_empty_tensor_value_info(manifest_tensor(model, split)))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    s = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return s.run([manifest_tensor(model, split)], {MODELS[model][0]: x})[0]


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def tar_of(members: list[tuple[str, bytes]]) -> bytes:
    """A tar archive of (name, data) members, in order (a WebDataset shard)."""
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def pushdown_get(s3, bucket, key, **fields):
    """GetObject with x-tensorgate-* headers added by a boto3 event hook (SigV4 stays intact)."""

    def add_headers(request, **_):
        for k, v in fields.items():
            request.headers[f"x-tensorgate-{k}"] = v

    s3.meta.events.register_first("before-sign.s3.GetObject", add_headers)
    try:
        return s3.get_object(Bucket=bucket, Key=key)
    finally:
        s3.meta.events.unregister("before-sign.s3.GetObject", add_headers)


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / max(np.linalg.norm(b.astype(np.float64)), 1e-30))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_pushdown_matches_reference(s3, bucket, model):
    input_name, shape, splits = MODELS[model]
    x = np.random.default_rng(11).random(shape, dtype=np.float32)
    s3.put_object(Bucket=bucket, Key="sample.npy", Body=npy_bytes(x))
    for split in splits:
        got = pushdown_get(s3, bucket, "sample.npy", model=model, split=split)
        assert got["ContentType"] == "application/x-npy"
        headers = got["ResponseMetadata"]["HTTPHeaders"]
        assert headers["x-tensorgate-split"] == split
        assert int(headers["x-tensorgate-source-bytes"]) == len(npy_bytes(x))
        y = np.load(io.BytesIO(got["Body"].read()))
        want = reference(model, split, x[None])[0]
        assert y.shape == want.shape
        assert headers["x-tensorgate-shape"] == ",".join(map(str, want.shape))
        err = rel_l2(y, want)
        print(f"{model} {split}: rel L2 {err:.2e}")
        assert err <= 1e-5


def test_batches_formats_dtypes_and_triggers(gateway, s3, bucket):
    x = np.random.default_rng(5).random((3, 3, 32, 32), dtype=np.float32)
    s3.put_object(Bucket=bucket, Key="batch.npy", Body=npy_bytes(x))
    want = reference("tiny-cnn", "block1", x)

    y = np.load(io.BytesIO(pushdown_get(s3, bucket, "batch.npy", model="tiny-cnn", split="block1")["Body"].read()))
    assert y.shape == want.shape and rel_l2(y, want) <= 1e-5

    half = np.load(io.BytesIO(pushdown_get(s3, bucket, "batch.npy", model="tiny-cnn", split="block1", dtype="f16")["Body"].read()))
    assert half.dtype == np.float16 and rel_l2(half.astype(np.float32), want) <= 1e-3

    st = pushdown_get(s3, bucket, "batch.npy", model="tiny-cnn", split="block1", format="safetensors", dtype="bf16")
    assert st["ContentType"] == "application/vnd.safetensors"
    raw = st["Body"].read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    assert header["features"]["dtype"] == "BF16" and header["features"]["shape"] == list(want.shape)
    assert header["__metadata__"] == {"model": "tiny-cnn", "split": "block1"}
    bf16 = np.frombuffer(raw[8 + n :], dtype=np.uint16).astype(np.uint32) << 16
    assert rel_l2(bf16.view(np.float32).reshape(want.shape), want) <= 1e-2

    # Query-parameter trigger on a presigned URL (the aws CLI / boto3 default is SigV2, whose
    # signature covers only S3 sub-resources, so the parameters can be appended to the URL).
    url = s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": "batch.npy"}, ExpiresIn=60)
    with urllib.request.urlopen(url + "&tensorgate-model=tiny-cnn&tensorgate-split=block1") as r:
        assert r.headers["Content-Type"] == "application/x-npy"
        q = np.load(io.BytesIO(r.read()))
    assert np.array_equal(q, y)

    # HEAD and Range work on the tensor output.
    full = pushdown_get(s3, bucket, "batch.npy", model="tiny-cnn", split="block1")
    body = full["Body"].read()
    ranged = urllib.request.Request(url + "&tensorgate-model=tiny-cnn&tensorgate-split=block1", headers={"Range": "bytes=0-127"})
    with urllib.request.urlopen(ranged) as r:
        assert r.status == 206 and r.read() == body[:128]
        assert r.headers["Content-Range"] == f"bytes 0-127/{len(body)}"
        assert r.headers["ETag"] == full["ETag"]


def test_any_order_a_client_names_is_served(s3, bucket):
    """`seq` at its extremes (the largest count, the longest stream name) and out of order: the
    same features, never an error."""
    s3.put_object(Bucket=bucket, Key="o.npy", Body=npy_bytes(np.ones((3, 32, 32), np.float32)))
    stream = "s" * 64
    bodies = {
        pushdown_get(s3, bucket, "o.npy", model="tiny-cnn", split="pool", seq=f"{stream}.{n}")["Body"].read()
        for n in (2**64 - 1, 2**64 - 1, 5, 0)
    }
    assert len(bodies) == 1


def test_bad_requests_name_what_is_wrong(s3, bucket):
    s3.put_object(Bucket=bucket, Key="s.npy", Body=npy_bytes(np.zeros((3, 32, 32), np.float32)))
    s3.put_object(Bucket=bucket, Key="text.txt", Body=b"not a tensor")
    s3.put_object(Bucket=bucket, Key="wrong.npy", Body=npy_bytes(np.zeros((3, 8, 8), np.float32)))
    cases = [
        (dict(model="nope", split="stem"), "s.npy", 400, "tiny-cnn"),
        (dict(model="tiny-cnn", split="nope"), "s.npy", 400, "block2"),
        (dict(model="tiny-cnn", split="stem", dtype="f64"), "s.npy", 400, "dtype"),
        (dict(model="tiny-cnn", split="stem"), "text.txt", 415, "not a JPEG or PNG image, a .npy tensor"),
        (dict(model="tiny-cnn", split="stem"), "wrong.npy", 400, "shape"),
        (dict(model="tiny-cnn", split="stem", seq="no stream"), "s.npy", 400, "seq"),
    ]
    for fields, key, status, needle in cases:
        with pytest.raises(botocore.exceptions.ClientError) as e:
            pushdown_get(s3, bucket, key, **fields)
        r = e.value.response
        assert r["ResponseMetadata"]["HTTPStatusCode"] == status, (fields, r)
        assert needle in r["Error"]["Message"], (fields, r["Error"])
    with pytest.raises(botocore.exceptions.ClientError) as e:
        pushdown_get(s3, bucket, "missing.npy", model="tiny-cnn", split="stem")
    assert e.value.response["Error"]["Code"] == "NoSuchKey"


def synthetic_photo(w: int, h: int, seed: int):
    """An ImageNet-like test picture: smooth gradients, shapes and texture (not a flat colour)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = np.stack([xx / w * 255, yy / h * 255, (xx + yy) / (w + h) * 255], axis=-1)
    base += rng.normal(0, 12, base.shape)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, w - 40)), int(rng.integers(0, h - 40))
        d.ellipse([x0, y0, x0 + int(rng.integers(20, 120)), y0 + int(rng.integers(20, 120))], fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
    return img


def reference_preprocess(img, model: str, manifest: dict | None = None) -> np.ndarray:
    """PIL + numpy, torchvision conventions (Resize(shorter) + CenterCrop), from the manifest
    (`models/<model>/manifest.toml` unless given)."""
    import tomllib

    from PIL import Image

    m = manifest or tomllib.loads((ROOT / "models" / model / "manifest.toml").read_text())
    p = m["preprocess"]
    img = img.convert("RGB")
    w, h = img.size
    s = p["resize_shorter"]
    size = (s, s * h // w) if w <= h else (s * w // h, s)
    img = img.resize(size, Image.BILINEAR)
    ch, cw = p["crop"]
    top, left = round((size[1] - ch) / 2), round((size[0] - cw) / 2)
    a = np.asarray(img, dtype=np.float32)[top : top + ch, left : left + cw]
    if p.get("channels", "RGB") == "BGR":
        a = a[..., ::-1]
    a = (a * np.float32(p["scale"]) - np.array(p["mean"], np.float32)) / np.array(p["std"], np.float32)
    return a.transpose(2, 0, 1) if m["layout"] == "NCHW" else a


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_pushdown_from_images(s3, bucket, model, fmt):
    img = synthetic_photo(500, 375, seed=len(model))
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    data = buf.getvalue()
    s3.put_object(Bucket=bucket, Key=f"img.{fmt.lower()}", Body=data)
    from PIL import Image

    x = reference_preprocess(Image.open(io.BytesIO(data)), model)[None].astype(np.float32)
    bound = 1e-3 if fmt == "JPEG" else 1e-4
    for split in MODELS[model][2]:
        got = pushdown_get(s3, bucket, f"img.{fmt.lower()}", model=model, split=split)
        y = np.load(io.BytesIO(got["Body"].read()))
        want = reference(model, split, x)[0]
        err = rel_l2(y, want)
        print(f"{model} {split} from {fmt}: rel L2 {err:.2e}")
        assert err <= bound, f"{model} {split} from {fmt}: rel L2 {err:.2e} > {bound}"


def png_bytes(a: np.ndarray, color_type: int, bit_depth: int) -> bytes:
    """A PNG written by hand (PIL cannot write 16-bit colour or 2/4-bit grey): `a` is H x W x C."""
    import struct
    import zlib

    h, w = a.shape[:2]
    if bit_depth == 16:
        rows = a.astype(">u2").reshape(h, -1).view(np.uint8)
    elif bit_depth == 8:
        rows = a.astype(np.uint8).reshape(h, -1)
    else:  # grey or palette indices, packed MSB first, each row padded to a byte
        bits = np.unpackbits(a.reshape(h, w, 1).astype(np.uint8), axis=2)[:, :, 8 - bit_depth :]
        rows = np.packbits(bits.reshape(h, -1), axis=1)
    raw = b"".join(b"\0" + r.tobytes() for r in rows)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def strip_jpeg_segment(data: bytes, marker: int) -> bytes:
    """The JPEG without its header segments of one marker type (e.g. 0xEE, APP14 "Adobe")."""
    out, i = bytearray(data[:2]), 2
    while data[i] == 0xFF and data[i + 1] != 0xDA:
        n = int.from_bytes(data[i + 2 : i + 4], "big")
        if data[i + 1] != marker:
            out += data[i : i + 2 + n]
        i += 2 + n
    return bytes(out + data[i:])


def mode_image(mode: str) -> tuple[str, bytes]:
    """(key, bytes) of a 120 x 90 test picture in one of the modes PIL reads."""
    import imagecodecs
    from PIL import Image

    photo = synthetic_photo(120, 90, seed=7)
    rgb = np.asarray(photo)
    grey = np.asarray(photo.convert("L"))

    def pil(img, fmt, key, **kw):
        buf = io.BytesIO()
        img.save(buf, format=fmt, **kw)
        return key, buf.getvalue()

    rgba = np.dstack([rgb, (np.arange(120)[None, :] * 2 + np.zeros((90, 1))).astype(np.uint8)])
    cmyk = np.dstack([255 - rgb, np.minimum(255 - rgb.max(axis=2), 90)[..., None]]).astype(np.uint8)
    if mode == "jpeg-grey":
        return pil(Image.fromarray(grey), "JPEG", "m.jpg", quality=90)
    if mode == "jpeg-progressive":
        return pil(photo, "JPEG", "m.jpg", quality=90, progressive=True)
    if mode == "jpeg-cmyk":  # PIL writes Adobe's inverted polarity and an APP14 marker
        return pil(Image.fromarray(cmyk, "CMYK"), "JPEG", "m.jpg", quality=90)
    if mode == "jpeg-cmyk-no-adobe":
        return "m.jpg", strip_jpeg_segment(pil(Image.fromarray(cmyk, "CMYK"), "JPEG", "m.jpg", quality=90)[1], 0xEE)
    if mode == "jpeg-ycck":  # Adobe transform 2, as Photoshop writes CMYK
        return "m.jpg", bytes(imagecodecs.jpeg8_encode(cmyk, level=90, colorspace="cmyk", outcolorspace="ycck"))
    if mode == "jpeg-named-png":
        return pil(photo, "JPEG", "m.png", quality=90)
    if mode == "png-named-jpg":
        return pil(photo, "PNG", "m.jpg")
    if mode == "png-L":
        return pil(Image.fromarray(grey), "PNG", "m.png")
    if mode == "png-LA":
        return pil(Image.fromarray(rgba[..., [0, 3]], "LA"), "PNG", "m.png")
    if mode == "png-RGBA":
        return pil(Image.fromarray(rgba, "RGBA"), "PNG", "m.png")
    if mode == "png-P":
        return pil(photo.quantize(200), "PNG", "m.png")
    if mode == "png-P-transparent":
        return pil(photo.quantize(200), "PNG", "m.png", transparency=3)
    if mode == "png-1bit":
        return pil(Image.fromarray(grey).convert("1"), "PNG", "m.png")
    if mode == "png-grey-2bit":
        return "m.png", png_bytes(grey[..., None] >> 6, 0, 2)
    if mode == "png-grey-4bit":
        return "m.png", png_bytes(grey[..., None] >> 4, 0, 4)
    if mode == "png-grey-16bit":  # PIL's I;16: values above 255 are clamped by convert("RGB")
        return "m.png", png_bytes(grey[..., None].astype(np.uint16) * 2, 0, 16)
    if mode == "png-LA-16bit":
        return "m.png", png_bytes(rgba[..., [0, 3]].astype(np.uint16) * 257 + 3, 4, 16)
    if mode == "png-RGB-16bit":
        return "m.png", png_bytes(rgb.astype(np.uint16) * 257 + 100, 2, 16)
    if mode == "png-RGBA-16bit":
        return "m.png", png_bytes(rgba.astype(np.uint16) * 256 + 255, 6, 16)
    raise AssertionError(mode)


IMAGE_MODES = [
    "jpeg-grey", "jpeg-progressive", "jpeg-cmyk", "jpeg-cmyk-no-adobe", "jpeg-ycck", "jpeg-named-png",
    "png-named-jpg", "png-L", "png-LA", "png-RGBA", "png-P", "png-P-transparent", "png-1bit",
    "png-grey-2bit", "png-grey-4bit", "png-grey-16bit", "png-LA-16bit", "png-RGB-16bit", "png-RGBA-16bit",
]  # fmt: skip


@pytest.mark.parametrize("mode", IMAGE_MODES)
def test_image_modes_match_pil(s3, bucket, mode):
    """Every mode gives the features of PIL's `open(...).convert("RGB")` + onnxruntime: PNG modes
    bit for bit (up to float summation order), JPEG modes within the JPEG bound above."""
    from PIL import Image

    key, data = mode_image(mode)
    key = f"modes/{mode}/{key}"
    s3.put_object(Bucket=bucket, Key=key, Body=data)
    opened = Image.open(io.BytesIO(data))
    x = reference_preprocess(opened, "tiny-cnn")[None].astype(np.float32)
    got = pushdown_get(s3, bucket, key, model="tiny-cnn", split="stem")
    y = np.load(io.BytesIO(got["Body"].read()))
    want = reference("tiny-cnn", "stem", x)[0]
    bound = 1e-3 if opened.format == "JPEG" else 1e-6
    err = rel_l2(y, want)
    print(f"{mode} (PIL mode {opened.mode}): rel L2 {err:.2e}")
    assert err <= bound, f"{mode} (PIL mode {opened.mode}): rel L2 {err:.2e} > {bound}"


def test_bad_images_get_clear_errors(s3, bucket):
    from PIL import Image

    buf = io.BytesIO()
    synthetic_photo(64, 48, 1).save(buf, format="PNG")
    png = buf.getvalue()
    s3.put_object(Bucket=bucket, Key="truncated.png", Body=png[: len(png) // 2])
    s3.put_object(Bucket=bucket, Key="corrupt.jpg", Body=b"\xff\xd8\xff\xe0" + b"\x00garbage" * 100)
    # A PNG whose header claims 100000 x 100000 pixels: refused before any decoding.
    import zlib

    huge = bytearray(png)
    huge[16:24] = (100000).to_bytes(4, "big") + (100000).to_bytes(4, "big")
    huge[29:33] = zlib.crc32(bytes(huge[12:29])).to_bytes(4, "big")  # keep the IHDR chunk valid
    s3.put_object(Bucket=bucket, Key="huge.png", Body=bytes(huge))
    # Found by fuzzing: a palette that is not whole RGB entries made the PNG decoder panic (a 500).
    plte = (ROOT / "fuzz" / "regressions" / "image" / "png-plte-not-rgb-triples-1.png").read_bytes()
    s3.put_object(Bucket=bucket, Key="plte.png", Body=plte)
    for key, needle in [("truncated.png", "image"), ("corrupt.jpg", "image"), ("huge.png", "100000x100000"),
                        ("plte.png", "palette")]:
        with pytest.raises(botocore.exceptions.ClientError) as e:
            pushdown_get(s3, bucket, key, model="tiny-cnn", split="stem")
        r = e.value.response
        assert r["ResponseMetadata"]["HTTPStatusCode"] == 400, (key, r)
        assert needle in r["Error"]["Message"], (key, r["Error"])


def test_webdataset_shard_gives_features_labels_and_keys(s3, bucket):
    import tarfile

    from PIL import Image

    buf = io.BytesIO()
    images = {}
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add(name, data):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for i in range(5):
            img = io.BytesIO()
            synthetic_photo(320, 240, seed=100 + i).save(img, format="JPEG" if i % 2 else "PNG")
            key = f"train/{i:04d}"
            images[key] = img.getvalue()
            add(f"{key}.{'jpg' if i % 2 else 'png'}", images[key])
            add(f"{key}.cls", str(i * 10).encode())
            add(f"{key}.json", b'{"ignored": true}')
    s3.put_object(Bucket=bucket, Key="shard-000.tar", Body=buf.getvalue())

    got = pushdown_get(s3, bucket, "shard-000.tar", model="tiny-cnn", split="pool")
    assert got["ContentType"] == "application/vnd.safetensors"
    raw = got["Body"].read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    feat_info, label_info = header["features"], header["labels"]
    feats = np.frombuffer(data[slice(*feat_info["data_offsets"])], dtype=np.float32).reshape(feat_info["shape"])
    labels = np.frombuffer(data[slice(*label_info["data_offsets"])], dtype=np.int64)
    keys = json.loads(header["__metadata__"]["keys"])
    assert keys == list(images)
    assert labels.tolist() == [0, 10, 20, 30, 40]
    x = np.stack([reference_preprocess(Image.open(io.BytesIO(images[k])), "tiny-cnn") for k in keys]).astype(np.float32)
    want = reference("tiny-cnn", "pool", x)
    assert feats.shape == want.shape
    err = rel_l2(feats, want)
    print(f"shard of 5 (PNG and JPEG): rel L2 {err:.2e}")
    assert err <= 1e-5


def test_bad_shards(s3, bucket):
    s3.put_object(Bucket=bucket, Key="empty.tar", Body=tar_of([("README.txt", b"nothing here")]))
    s3.put_object(Bucket=bucket, Key="junk.tar", Body=tar_of([("a.jpg", b"\xff\xd8\xffnot really\xff\xd9")]))
    for key, needle in [("empty.tar", "no samples"), ("junk.tar", '"a"')]:
        with pytest.raises(botocore.exceptions.ClientError) as e:
            pushdown_get(s3, bucket, key, model="tiny-cnn", split="stem")
        r = e.value.response
        assert r["ResponseMetadata"]["HTTPStatusCode"] == 400, (key, r)
        assert needle in r["Error"]["Message"], (key, r["Error"])


def test_alias_bucket_with_the_aws_cli(gateway, s3, client_env, tmp_path):
    """A loader that cannot add headers reads alias-tiny-pool/KEY and gets features of alias-target/KEY."""
    import subprocess

    from conftest import ROOT

    try:
        s3.create_bucket(Bucket="alias-target")
    except botocore.exceptions.ClientError as e:
        assert e.response["Error"]["Code"] in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou")
    x = np.random.default_rng(2).random((3, 32, 32), dtype=np.float32)
    s3.put_object(Bucket="alias-target", Key="x.npy", Body=npy_bytes(x))
    endpoint, _, _ = gateway
    out = tmp_path / "features.npy"
    subprocess.run([str(ROOT / ".venv/bin/aws"), "--endpoint-url", endpoint, "s3", "cp", "s3://alias-tiny-pool/x.npy", str(out)], env=client_env, check=True, capture_output=True)
    y = np.load(out)
    assert rel_l2(y, reference("tiny-cnn", "pool", x[None])[0]) <= 1e-5
    # Other tests share the alias's bucket (and a page of an alias listing holds 100 entries).
    listed = s3.list_objects_v2(Bucket="alias-tiny-pool", Prefix="x.npy")
    assert "x.npy" in [o["Key"] for o in listed.get("Contents", [])]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="alias-tiny-pool", Key="y.npy", Body=b"x")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 405


def test_without_onnx_runtime_passthrough_serves_and_pushdown_says_why(tmp_path):
    import os
    import subprocess

    from conftest import BINARY, free_port, wait_ready

    port, admin = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORGATE_", "ORT_"))}
    env.update(
        TENSORGATE_LISTEN=f"127.0.0.1:{port}",
        TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin}",
        TENSORGATE_BACKEND_ROOT=str(tmp_path / "data"),
        TENSORGATE_MODELS_DIR=str(ROOT / "models"),
        TENSORGATE_ORT_LIBRARY=str(tmp_path / "missing" / "libonnxruntime.so"),
    )
    proc = subprocess.Popen([str(BINARY)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{admin}", proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz") as r:
            text = r.read().decode()
        assert "pushdown: unavailable" in text and "missing" in text, text
        import boto3

        c = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id="tensorgate-dev", aws_secret_access_key="tensorgate-dev-secret", region_name="us-east-1")
        assert c.get_object(Bucket="demo", Key="sample-0.png")["Body"].read().startswith(b"\x89PNG")
        with pytest.raises(botocore.exceptions.ClientError) as e:
            pushdown_get(c, "demo", "sample-0.png", model="tiny-cnn", split="pool")
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
        assert "pushdown is unavailable" in e.value.response["Error"]["Message"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_head_describes_the_tensor_output(s3, bucket):
    x = np.random.default_rng(9).random((3, 32, 32), dtype=np.float32)
    s3.put_object(Bucket=bucket, Key="h.npy", Body=npy_bytes(x))
    body = pushdown_get(s3, bucket, "h.npy", model="tiny-cnn", split="block1")["Body"].read()

    def add(request, **_):
        request.headers["x-tensorgate-model"] = "tiny-cnn"
        request.headers["x-tensorgate-split"] = "block1"

    s3.meta.events.register_first("before-sign.s3.HeadObject", add)
    try:
        head = s3.head_object(Bucket=bucket, Key="h.npy")
    finally:
        s3.meta.events.unregister("before-sign.s3.HeadObject", add)
    assert head["ContentLength"] == len(body)
    assert head["ContentType"] == "application/x-npy"
    assert head["ResponseMetadata"]["HTTPHeaders"]["x-tensorgate-shape"] == "16,16,16"


def test_full_queue_answers_slowdown(tmp_path):
    """A tiny queue and six concurrent 16-sample batches: one request alone keeps at most half the
    queue in flight, so it never fills it; together they do, and samples beyond the queue get
    503 SlowDown + Retry-After."""
    import concurrent.futures as cf

    from conftest import run_gateway

    with run_gateway(tmp_path, "[pushdown]\nqueue_capacity = 2\nmax_batch = 1\nworkers = 1\n") as (_, _, c, _):
        c.put_object(Bucket="demo", Key="big.npy", Body=npy_bytes(np.zeros((16, 3, 224, 224), np.float32)))
        # Alone, a request of 16 samples through a queue of 2 is served.
        assert pushdown_get(c, "demo", "big.npy", model="resnet18", split="layer3")["ContentType"] == "application/x-npy"

        import urllib.error
        import urllib.request

        # Presigned query triggers: one boto3 client's event hooks are not for concurrent threads.
        urls = []
        for i in range(6):
            c.put_object(Bucket="demo", Key=f"big{i}.npy", Body=npy_bytes(np.zeros((16, 3, 224, 224), np.float32)))
            urls.append(c.generate_presigned_url("get_object", Params={"Bucket": "demo", "Key": f"big{i}.npy"})
                        + "&tensorgate-model=resnet18&tensorgate-split=layer3")

        def one(url):
            try:
                with urllib.request.urlopen(url) as r:
                    r.read()
                return None
            except urllib.error.HTTPError as e:
                return e.code, e.headers.get("retry-after"), e.read().decode()

        with cf.ThreadPoolExecutor(6) as ex:
            refused = [r for r in ex.map(one, urls) if r is not None]
        assert refused, "six requests at once fill a queue of 2"
        status, retry_after, body = refused[0]
        assert (status, retry_after) == (503, "1"), refused[0]
        assert "<Code>SlowDown</Code>" in body
        # The gateway stays up and serves the next (small) request.
        c.put_object(Bucket="demo", Key="one.npy", Body=npy_bytes(np.zeros((3, 224, 224), np.float32)))
        assert pushdown_get(c, "demo", "one.npy", model="resnet18", split="layer3")["ContentType"] == "application/x-npy"


def test_bad_inputs_under_repetition_do_not_crash_or_leak(tmp_path):
    """300 bad pushdown requests (corrupt, truncated, oversized-header images, junk shards, wrong
    shapes): the process stays up and its resident memory settles (growth after warm-up bounded)."""
    import os
    import tarfile
    import zlib

    from conftest import run_gateway

    with run_gateway(tmp_path) as (_, _, c, pid):

        def rss_kib():
            with open(f"/proc/{pid}/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))

        buf = io.BytesIO()
        synthetic_photo(64, 48, 1).save(buf, format="PNG")
        png = buf.getvalue()
        huge = bytearray(png)
        huge[16:24] = (100000).to_bytes(4, "big") + (100000).to_bytes(4, "big")
        huge[29:33] = zlib.crc32(bytes(huge[12:29])).to_bytes(4, "big")
        jpg = io.BytesIO()
        synthetic_photo(64, 48, 2).save(jpg, format="JPEG")
        tar = io.BytesIO()
        with tarfile.open(fileobj=tar, mode="w") as t:
            info = tarfile.TarInfo("a.jpg")
            info.size = 20
            t.addfile(info, io.BytesIO(b"\xff\xd8\xff" + b"\x00" * 15 + b"\xff\xd9"))
        bad = {
            "truncated.png": png[: len(png) // 2],
            "huge.png": bytes(huge),
            "corrupt.jpg": jpg.getvalue()[:200] + b"\x00" * 500 + b"\xff\xd9",
            "junk.tar": tar.getvalue(),
            "shape.npy": npy_bytes(np.zeros((3, 8, 8), np.float32)),
            "text.bin": b"hello" * 100,
        }
        for k, v in bad.items():
            c.put_object(Bucket="demo", Key=k, Body=v)

        def round_():
            for k in bad:
                try:
                    pushdown_get(c, "demo", k, model="tiny-cnn", split="pool")
                    raise AssertionError(f"{k} was accepted")
                except botocore.exceptions.ClientError as e:
                    assert e.response["ResponseMetadata"]["HTTPStatusCode"] in (400, 415), (k, e.response)

        for _ in range(10):
            round_()
        warm = rss_kib()
        for _ in range(40):
            round_()
        grown = rss_kib() - warm
        print(f"RSS after warm-up {warm / 1024:.1f} MiB, growth over 240 more bad requests {grown / 1024:.1f} MiB")
        assert os.path.exists(f"/proc/{pid}/status"), "the gateway exited"
        assert grown < 16 * 1024, f"RSS grew {grown / 1024:.1f} MiB"


def test_costs_are_bounded_from_headers_per_request_and_per_sample(s3, bucket, tmp_path):
    """A request's images are refused from their headers when they would decode and resize more
    than pushdown.max_request_pixels in all; a thin image whose resized copy would exceed
    max_image_pixels is refused inside a shard, naming its member; the gateway stays up and serves
    the next request."""
    import os

    from conftest import run_gateway

    def png(w, h):
        from PIL import Image

        buf = io.BytesIO()
        (synthetic_photo(w, h, 3) if w > 40 else Image.fromarray(np.zeros((h, w, 3), np.uint8))).save(buf, format="PNG")
        return buf.getvalue()

    # tiny-cnn resizes the shorter side to 36: a 200 x 150 image is 30,000 + 48 x 36 pixels of work.
    per_image = 200 * 150 + 48 * 36
    config = f"[pushdown]\nmax_request_pixels = {3 * per_image}\n"
    with run_gateway(tmp_path, config) as (_, _, c, pid):
        three = tar_of([(f"s/{i}.png", png(200, 150)) for i in range(3)])
        four = tar_of([(f"s/{i}.png", png(200, 150)) for i in range(4)])
        for k, v in {"three.tar": three, "four.tar": four}.items():
            c.put_object(Bucket="demo", Key=k, Body=v)
        assert pushdown_get(c, "demo", "three.tar", model="tiny-cnn", split="stem")["Body"].read()
        with pytest.raises(botocore.exceptions.ClientError) as e:
            pushdown_get(c, "demo", "four.tar", model="tiny-cnn", split="stem")
        r = e.value.response
        assert r["ResponseMetadata"]["HTTPStatusCode"] == 400, r
        assert "max_request_pixels" in r["Error"]["Message"] and str(4 * per_image) in r["Error"]["Message"], r["Error"]
        assert os.path.exists(f"/proc/{pid}/status"), "the gateway exited"
        assert pushdown_get(c, "demo", "three.tar", model="tiny-cnn", split="stem")["Body"].read()
    # Under the default request bound, the thin member itself is refused by name.
    s3.put_object(Bucket=bucket, Key="thin.tar", Body=tar_of([("s/ok.png", png(200, 150)), ("s/thin.png", png(1, 65535))]))
    with pytest.raises(botocore.exceptions.ClientError) as e:
        pushdown_get(s3, bucket, "thin.tar", model="tiny-cnn", split="stem")
    r = e.value.response
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 400, r
    for needle in ['"s/thin"', "36x2359260", "max_image_pixels"]:
        assert needle in r["Error"]["Message"], (needle, r["Error"])


def test_jpeg_with_repeated_scans_is_refused_before_decoding(s3, bucket):
    """Each scan of a progressive JPEG is a pass over the whole image, and libjpeg only warns when a
    progression repeats itself: 1,000 copies of a 31-byte scan of a flat 4000 x 4000 JPEG make a
    125 KB file that costs PIL ~20 s of CPU here. The gateway counts scans first and refuses."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4000, 4000), (128, 128, 128)).save(buf, "JPEG", quality=90, progressive=True)
    d = buf.getvalue()
    sos = [i for i in range(len(d) - 1) if d[i] == 0xFF and d[i + 1] == 0xDA]
    assert 2 <= len(sos) <= 20, "PIL's progression has about 10 scans, under the gateway's limit"
    smallest = min(range(len(sos) - 1), key=lambda i: sos[i + 1] - sos[i])
    scan = d[sos[smallest] : sos[smallest + 1]]
    s3.put_object(Bucket=bucket, Key="progressive.jpg", Body=d)
    s3.put_object(Bucket=bucket, Key="scans.jpg", Body=d[: sos[-1]] + scan * 1000 + d[sos[-1] :])
    assert pushdown_get(s3, bucket, "progressive.jpg", model="tiny-cnn", split="stem")["Body"].read()
    with pytest.raises(botocore.exceptions.ClientError) as e:
        pushdown_get(s3, bucket, "scans.jpg", model="tiny-cnn", split="stem")
    r = e.value.response
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 400, r
    assert "scans" in r["Error"]["Message"], r["Error"]


def test_pushdown_metrics(gateway, s3, bucket):
    x = np.random.default_rng(4).random((4, 3, 32, 32), dtype=np.float32)
    s3.put_object(Bucket=bucket, Key="m.npy", Body=npy_bytes(x))
    body = pushdown_get(s3, bucket, "m.npy", model="tiny-cnn", split="stem")["Body"].read()
    _, admin, _ = gateway
    with urllib.request.urlopen(f"{admin}/metrics") as r:
        text = r.read().decode()
    for needle in [
        'tensorgate_pushdown_requests_total{model="tiny-cnn",split="stem"}',
        'tensorgate_pushdown_samples_total{model="tiny-cnn",split="stem"}',
        'tensorgate_pushdown_source_bytes_total{model="tiny-cnn",split="stem"}',
        'tensorgate_pushdown_output_bytes_total{model="tiny-cnn",split="stem"}',
        'tensorgate_pushdown_batch_size_bucket{',
        'tensorgate_pushdown_queue_depth{model="tiny-cnn",split="stem"}',
        'stage="queue"',
        'stage="decode"',
    ]:
        assert needle in text, needle
    out_line = next(l for l in text.splitlines() if l.startswith('tensorgate_pushdown_output_bytes_total{model="tiny-cnn",split="stem"}'))
    assert float(out_line.split()[-1]) >= len(body)
