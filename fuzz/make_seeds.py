"""Writes the seed corpora (fuzz/corpus/<target>/) for the fuzz targets of fuzz/src/lib.rs.

    .venv/bin/python fuzz/make_seeds.py     # deterministic; the output is committed

Requests are signed with the targets' fixed key and clock (lib.rs: ACCESS_KEY, SECRET_KEY,
NOW_UNIX = 2026-01-01T00:00:00Z), so verification runs to its end. Seeds stay small (AFL works
best under 1 KiB; the ONNX seed is a few hundred bytes).
"""

import base64
import hashlib
import hmac
import io
import json
import shutil
import struct
import tarfile
import zlib
from pathlib import Path

import imagecodecs
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

OUT = Path(__file__).resolve().parent / "corpus"
AK, SK = "AKIDEXAMPLE", "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY"
DATE, AMZ_DATE, REGION = "20260101", "20260101T000000Z", "us-east-1"
SCOPE = f"{DATE}/{REGION}/s3/aws4_request"
EMPTY = hashlib.sha256(b"").hexdigest()


def write(target: str, name: str, data: bytes) -> None:
    d = OUT / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def hm(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def signing_key() -> bytes:
    k = hm(("AWS4" + SK).encode(), DATE)
    return hm(hm(hm(k, REGION), "s3"), "aws4_request")


def sigv4_headers(method: str, path: str, query: str, headers: dict[str, str], payload: str) -> str:
    """The Authorization header for a request (headers lowercased, all signed)."""
    names = sorted(headers)
    canonical_q = "&".join(sorted(query.split("&"))) if query else ""
    creq = "\n".join(
        [method, path, canonical_q, "".join(f"{n}:{headers[n].strip()}\n" for n in names), ";".join(names), payload]
    )
    sts = "\n".join(["AWS4-HMAC-SHA256", AMZ_DATE, SCOPE, hashlib.sha256(creq.encode()).hexdigest()])
    sig = hmac.new(signing_key(), sts.encode(), hashlib.sha256).hexdigest()
    return f"AWS4-HMAC-SHA256 Credential={AK}/{SCOPE}, SignedHeaders={';'.join(names)}, Signature={sig}"


def request(method: str, uri: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    head = f"{method} {uri}\n" + "".join(f"{k}: {v}\n" for k, v in headers.items())
    return head.encode() + (b"\n" + body if body else b"")


def sigv4_seeds() -> None:
    h = {"host": "127.0.0.1:9000", "x-amz-content-sha256": "UNSIGNED-PAYLOAD", "x-amz-date": AMZ_DATE}
    h["authorization"] = sigv4_headers("GET", "/bucket/key", "", {k: h[k] for k in list(h)}, "UNSIGNED-PAYLOAD")
    write("sigv4", "get-header", request("GET", "/bucket/key", h))
    body = b"hello"
    h = {"host": "bucket.s3.example.com", "x-amz-content-sha256": hashlib.sha256(body).hexdigest(), "x-amz-date": AMZ_DATE}
    h["authorization"] = sigv4_headers("PUT", "/key", "", dict(h), h["x-amz-content-sha256"])
    write("sigv4", "put-vhost", request("PUT", "/key", h, body))
    h = {"host": "127.0.0.1:9000", "x-amz-content-sha256": "STREAMING-UNSIGNED-PAYLOAD-TRAILER", "x-amz-date": AMZ_DATE,
         "x-amz-decoded-content-length": "5", "x-amz-trailer": "x-amz-checksum-crc32", "content-encoding": "aws-chunked"}
    h["authorization"] = sigv4_headers("PUT", "/b/k", "", dict(h), h["x-amz-content-sha256"])
    write("sigv4", "put-trailer", request("PUT", "/b/k", h))
    q = (f"X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential={AK}%2F{DATE}%2F{REGION}%2Fs3%2Faws4_request"
         f"&X-Amz-Date={AMZ_DATE}&X-Amz-Expires=3600&X-Amz-SignedHeaders=host")
    creq = "\n".join(["GET", "/b/k", q, "host:127.0.0.1:9000\n", "host", "UNSIGNED-PAYLOAD"])
    sts = "\n".join(["AWS4-HMAC-SHA256", AMZ_DATE, SCOPE, hashlib.sha256(creq.encode()).hexdigest()])
    sig = hmac.new(signing_key(), sts.encode(), hashlib.sha256).hexdigest()
    write("sigv4", "presigned", request("GET", f"/b/k?{q}&X-Amz-Signature={sig}", {"host": "127.0.0.1:9000"}))
    date = "Thu, 01 Jan 2026 00:00:00 GMT"
    sts2 = f"GET\n\n\n{date}\n/b/k"
    sig2 = base64.b64encode(hmac.new(SK.encode(), sts2.encode(), hashlib.sha1).digest()).decode()
    write("sigv4", "v2-header", request("GET", "/b/k", {"host": "127.0.0.1", "date": date, "authorization": f"AWS {AK}:{sig2}"}))
    write("sigv4", "v2-presigned", request("GET", f"/b/k?AWSAccessKeyId={AK}&Expires=1767229200&Signature=abc%3D", {}))
    write("sigv4", "anonymous", request("GET", "/b/k", {"host": "127.0.0.1"}))
    write("sigv4", "options", request("OPTIONS", "/b/k", {"origin": "http://x", "access-control-request-method": "PUT"}))


def chunked_seeds() -> None:
    def seed(flags: int, frame: int, decoded: int, body: bytes) -> bytes:
        return bytes([flags]) + struct.pack("<HI", frame, decoded) + body

    crc = base64.b64encode(zlib.crc32(b"hello").to_bytes(4, "big")).decode()
    write("aws_chunked", "unsigned", seed(0, 4096, 5, b"5\r\nhello\r\n0\r\n\r\n"))
    write("aws_chunked", "trailer-crc32", seed(2, 3, 5, f"5\r\nhello\r\n0\r\nx-amz-checksum-crc32:{crc}\r\n\r\n".encode()))
    write("aws_chunked", "signed", seed(1 | 2 << 2, 4096, 5, b"5;chunk-signature=" + b"a" * 64 + b"\r\nhello\r\n0;chunk-signature=" + b"b" * 64 + b"\r\n\r\n"))
    write("aws_chunked", "two-chunks", seed(2 | 1 << 2, 7, 8, b"3\r\nabc\r\n5\r\ndefgh\r\n0\r\nx-amz-checksum-crc32c:AAAAAA==\r\n\r\n"))


def route_seeds() -> None:
    write("route", "vhost", b"bucket.s3.example.com\n/key/with%20space\n\nGET\n")
    write("route", "path", b"localhost:9000\n/b/k\nuploads\nPOST\n")
    write("route", "part-copy", b"\n/b/k\npartNumber=1&uploadId=x\nPUT\n/src/a%2Fb?versionId=1")
    write("route", "service", b"127.0.0.1\n/\n\nGET\n")
    write("route", "tagging", b"127.0.0.1\n/b/k\ntagging&versionId=2\nDELETE\n")


def fs_listing_seeds() -> None:
    listing = (b'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult><Name>b</Name><Prefix>d/</Prefix>'
               b'<Delimiter>/*</Delimiter><Contents><Key>d/a b+c%&amp;\xc3\xa9</Key><Size>3</Size></Contents>'
               b'<CommonPrefixes><Prefix>d/x/</Prefix></CommonPrefixes><EncodingType>url</EncodingType>'
               b'<IsTruncated>false</IsTruncated></ListBucketResult>')
    write("fs_listing", "v2-encoded", b"list-type=2&delimiter=%2F%2A&encoding-type=url&prefix=d%2F\n" + listing)
    write("fs_listing", "crt-empty-delimiter", b"list-type=2&delimiter=&max-keys=1000&prefix=d%2F\n" + listing)
    write("fs_listing", "v1-marker", b"marker=d%2F2%20x&encoding-type=url\n" + listing)


def spec_seeds() -> None:
    write("spec", "headers", request("GET", "/b/k", {"x-tensorgate-model": "tiny-cnn", "x-tensorgate-split": "pool",
                                                      "x-tensorgate-format": "safetensors", "x-tensorgate-dtype": "bf16"}))
    write("spec", "query", b"GET /b/k?x-tensorgate-model=tiny-cnn&x-tensorgate-split=stem&x-tensorgate-batch=4&x-tensorgate-format=npy\n")
    write("spec", "auto", request("GET", "/b/k?x-tensorgate-dtype=f16", {"x-tensorgate-model": "m", "x-tensorgate-split": "auto"}))


def small_images() -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (12, 16, 3), dtype=np.uint8)
    out = {}

    def save(name, img, fmt, **kw):
        b = io.BytesIO()
        img.save(b, format=fmt, **kw)
        out[name] = b.getvalue()

    save("rgb.jpg", Image.fromarray(rgb), "JPEG", quality=80)
    save("grey.jpg", Image.fromarray(rgb[..., 0]), "JPEG", quality=80)
    save("progressive.jpg", Image.fromarray(rgb), "JPEG", quality=80, progressive=True)
    cmyk = np.dstack([rgb, rgb[..., :1]])
    save("cmyk.jpg", Image.fromarray(cmyk, "CMYK"), "JPEG", quality=80)
    out["ycck.jpg"] = bytes(imagecodecs.jpeg8_encode(cmyk, level=80, colorspace="cmyk", outcolorspace="ycck"))
    save("rgb.png", Image.fromarray(rgb), "PNG")
    save("la.png", Image.fromarray(rgb[..., :2], "LA"), "PNG")
    save("rgba.png", Image.fromarray(np.dstack([rgb, rgb[..., :1]]), "RGBA"), "PNG")
    save("p.png", Image.fromarray(rgb).quantize(16), "PNG", transparency=2)
    save("1bit.png", Image.fromarray(rgb[..., 0]).convert("1"), "PNG")
    save("grey16.png", Image.fromarray(rgb[..., 0].astype(np.uint16) * 3), "PNG")
    return out


def image_seeds() -> None:
    for name, data in small_images().items():
        write("image", name, data)


def npy(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def shard_seeds() -> None:
    imgs = small_images()
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in [("s/0001.jpg", imgs["rgb.jpg"]), ("s/0001.cls", b"3"), ("s/0002.png", imgs["p.png"]),
                           ("s/0002.cls", b"7"), ("s/0003.npy", npy(np.zeros((3, 2, 2), np.float32))), ("s/0003.cls", b"1"),
                           ("s/0003.json", b"{}")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    write("shard", "mixed.tar", b.getvalue())


def parquet_seeds() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    imgs = small_images()
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    tables = {
        "hf.parquet": pa.table({"image": pa.array([{"bytes": imgs["rgb.jpg"], "path": "a.jpg"},
                                                   {"bytes": imgs["p.png"], "path": None}], type=image),
                                "label": pa.array([3, 7], pa.int64())}),
        "bare.parquet": pa.table({"image": pa.array([imgs["p.png"], None], pa.binary()),
                                  "label": pa.array([1, None], pa.int16())}),
    }
    for (name, table), codec in zip(tables.items(), ["snappy", "none"]):
        b = io.BytesIO()
        pq.write_table(table, b, row_group_size=1, compression=codec, store_schema=False, write_statistics=False)
        write("parquet", name, b.getvalue())


def npy_seeds() -> None:
    write("npy", "f32-batch.npy", npy(np.arange(24, dtype=np.float32).reshape(2, 3, 2, 2)))
    write("npy", "f16.npy", npy(np.array([1.5, -2, np.inf], np.float16)))
    write("npy", "f64-scalar.npy", npy(np.float64(3.25)))
    write("npy", "f32-nan.npy", npy(np.array([[np.nan, 0.0]], np.float32)))


def disk_entry_seeds() -> None:
    body = b"\x01\x02\x03\x04" * 4
    header = {"key": {"object": {"bucket": "b", "key": "k.jpg", "query": ""}, "variant": "m@sha/pool/npy/f32"},
              "meta": {"content_type": "application/x-npy", "shape": [1, 4], "split": "pool", "dtype": "f32",
                       "source_etag": "\"abc\"", "source_last_modified": None, "source_bytes": 1234},
              "body_len": len(body), "body_crc32": zlib.crc32(body)}
    raw = json.dumps(header).encode()
    write("disk_entry", "entry.tgc", b"TGC1" + struct.pack("<I", len(raw)) + raw + body)


def prefix_seeds() -> None:
    w = numpy_helper.from_array(np.ones((2, 1, 1, 1), np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"), helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("GlobalAveragePool", ["r"], ["y"], name="pool")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 1, 1])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="seed")
    onnx.checker.check_model(m)
    data = m.SerializeToString()
    for pick in range(3):
        write("prefix", f"conv-relu-pool-{pick}", bytes([pick]) + data)


def post_form_seeds() -> None:
    policy = {"expiration": "2026-01-02T00:00:00.000Z", "conditions": [
        {"bucket": "bucket"}, ["starts-with", "$key", "up/"], {"x-amz-algorithm": "AWS4-HMAC-SHA256"},
        {"x-amz-credential": f"{AK}/{SCOPE}"}, {"x-amz-date": AMZ_DATE}, ["content-length-range", 0, 100],
        ["starts-with", "$Content-Type", "image/"]]}
    p64 = base64.b64encode(json.dumps(policy).encode()).decode()
    sig = hmac.new(signing_key(), p64.encode(), hashlib.sha256).hexdigest()
    fields = [("key", "up/${filename}"), ("Content-Type", "image/png"), ("x-amz-algorithm", "AWS4-HMAC-SHA256"),
              ("x-amz-credential", f"{AK}/{SCOPE}"), ("x-amz-date", AMZ_DATE), ("policy", p64), ("x-amz-signature", sig),
              ("success_action_status", "201")]

    def form(fields, boundary="XyZ"):
        parts = b"".join(f"--{boundary}\r\nContent-Disposition: form-data; name=\"{n}\"\r\n\r\n{v}\r\n".encode() for n, v in fields)
        file = f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.png\"\r\nContent-Type: image/png\r\n\r\n".encode()
        return f"multipart/form-data; boundary={boundary}\n".encode() + parts + file + b"data\r\n--" + boundary.encode() + b"--\r\n"

    write("post_form", "sigv4", form(fields))
    v2 = base64.b64encode(hmac.new(SK.encode(), p64.encode(), hashlib.sha1).digest()).decode()
    write("post_form", "sigv2", form([("key", "up/x"), ("AWSAccessKeyId", AK), ("policy", p64), ("signature", v2)], "b0undary"))
    write("post_form", "anonymous", form([("key", "public/x"), ("acl", "public-read")]))


if __name__ == "__main__":
    shutil.rmtree(OUT, ignore_errors=True)
    for make in [sigv4_seeds, chunked_seeds, route_seeds, spec_seeds, image_seeds, shard_seeds, parquet_seeds, npy_seeds,
                 disk_entry_seeds, prefix_seeds, post_form_seeds, fs_listing_seeds]:
        make()
    for d in sorted(OUT.iterdir()):
        print(f"{d.name}: {len(list(d.iterdir()))} seeds, {sum(f.stat().st_size for f in d.iterdir())} bytes")
