"""The container image beside a real SeaweedFS (scripts/container-test.sh starts both): the aws CLI
and boto3 through it, and pushdowns through it bit-identical to the same pushdowns through the
binary of this checkout (ONNX Runtime and the models really are in the image)."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from conftest import run_gateway  # noqa: E402
from test_pushdown import npy_bytes, synthetic_photo  # noqa: E402

CONTAINER = os.environ.get("CONTAINER_ENDPOINT", "http://127.0.0.1:19953")
SEAWEED = os.environ.get("CONTAINER_SEAWEED", "http://127.0.0.1:18833")
AK, SK = "ct-ak", "ct-sk"


def client(endpoint, ak=AK, sk=SK):
    return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ak, aws_secret_access_key=sk,
                        region_name="us-east-1", config=Config(s3={"addressing_style": "path"}))


def pushdown(s3, bucket, key, model, split):
    def add(request, **_):
        request.headers["x-tensorgate-model"], request.headers["x-tensorgate-split"] = model, split
    s3.meta.events.register_first("before-sign.s3.GetObject", add)
    try:
        r = s3.get_object(Bucket=bucket, Key=key)
        return r["Body"].read(), r["ResponseMetadata"]["HTTPHeaders"]
    finally:
        s3.meta.events.unregister("before-sign.s3.GetObject", add)


@pytest.fixture(scope="module")
def objects():
    s3 = client(CONTAINER)
    s3.create_bucket(Bucket="container")
    import numpy as np

    x = np.random.default_rng(1).random((3, 32, 32), dtype=np.float32)
    photo = io.BytesIO()
    synthetic_photo(500, 375, seed=3).save(photo, format="JPEG", quality=90)
    s3.put_object(Bucket="container", Key="x.npy", Body=npy_bytes(x))
    s3.put_object(Bucket="container", Key="photo.jpg", Body=photo.getvalue())
    return s3, photo.getvalue()


def test_boto3_and_the_aws_cli_through_the_container(objects, tmp_path):
    s3, photo = objects
    assert s3.get_object(Bucket="container", Key="photo.jpg")["Body"].read() == photo
    env = dict(os.environ, AWS_ACCESS_KEY_ID=AK, AWS_SECRET_ACCESS_KEY=SK, AWS_DEFAULT_REGION="us-east-1")
    out = subprocess.run([str(ROOT / ".venv/bin/aws"), "--endpoint-url", CONTAINER, "s3", "ls", "s3://container/"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and "photo.jpg" in out.stdout and "x.npy" in out.stdout, out.stderr


def test_pushdowns_through_the_container_equal_the_binary_bit_for_bit(objects, tmp_path):
    s3, _ = objects
    env = {"TENSORGATE_ACCESS_KEY": AK, "TENSORGATE_SECRET_KEY": SK}
    with run_gateway(tmp_path, "", seaweed=SEAWEED, env=env) as (endpoint, _, _, _):
        binary = client(endpoint)
        for key, model, split in (("x.npy", "tiny-cnn", "pool"), ("photo.jpg", "pp-lcnet", "pool"),
                                  ("photo.jpg", "resnet50-thin", "stage1")):
            a, ha = pushdown(s3, "container", key, model, split)
            b, _ = pushdown(binary, "container", key, model, split)
            assert ha["x-tensorgate-split"] == split and len(a) > 0
            assert a == b, f"{key} {model} {split}: the container's output differs"
