"""Models kept in a bucket of the store (`[pushdown.models_store]`), read by the three members of a
cluster: a model written there with the aws CLI, as docs/pushdown.md says, is served by every member within seconds,
without a restart, equals the same weights from `models_dir`, and each member's `/v1/cluster` says
when they all agree; a removed one stops being served
on every member, its engines' memory returned; hostile models (a hash that does not match, bytes
that are not ONNX, a split naming a tensor the graph lacks, a file over `max_model_bytes`, a
nested key) are refused with their reasons on every member and the rest serves on; a user without
the store's rights on the bucket cannot add one. On the store the tests run against
(TENSORGATE_TEST_STORE: SeaweedFS, Ceph RGW, Swift)."""

import contextlib
import hashlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import urllib.request
import uuid

import boto3
import numpy as np
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError
from PIL import Image

from conftest import ROOT, STORE_KIND, free_port, run_gateway
from test_cluster import cluster_config, cluster_report, wait_states
from test_models_runtime import listing, until
from test_pushdown import pushdown_get

pytestmark = pytest.mark.skipif(STORE_KIND == "fs", reason="the models store is a bucket of an S3 store")

TINY = ROOT / "models" / "tiny-cnn"
AWS = str(ROOT / ".venv" / "bin" / "aws")
PREFIX = "tensorgate/"
# Small enough that a 2 MiB file is over it; tiny-cnn's ONNX file is 16 KiB.
MAX_MODEL_BYTES = 1 << 20


def store_client(store, alt=False):
    ak, sk = (store["alt_access_key"], store["alt_secret_key"]) if alt else (store["access_key"], store["secret_key"])
    return boto3.client("s3", endpoint_url=store["endpoint"], aws_access_key_id=ak, aws_secret_access_key=sk,
                        region_name="us-east-1",
                        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))


def put_model(s3, bucket, name, edit=lambda m: m, onnx=None):
    """tiny-cnn's files under `models/<name>/`, the manifest last (a sync takes a model once its
    manifest is there), edited by `edit`."""
    onnx = (TINY / "model.onnx").read_bytes() if onnx is None else onnx
    s3.put_object(Bucket=bucket, Key=f"{PREFIX}{name}/model.onnx", Body=onnx)
    manifest = (TINY / "manifest.toml").read_text().replace('name = "tiny-cnn"', f'name = "{name}"')
    s3.put_object(Bucket=bucket, Key=f"{PREFIX}{name}/manifest.toml", Body=edit(manifest).encode())


def features(s3, bucket, model):
    body = pushdown_get(s3, bucket, "img.png", model=model, split="pool")["Body"].read()
    return np.load(io.BytesIO(body))


def memory_engines(admin):
    with urllib.request.urlopen(f"{admin}/v1/memory") as r:
        return [e["model"] for e in json.loads(r.read())["engines"]]


@pytest.fixture(scope="module")
def members(store, tmp_path_factory):
    """Three members reading one models bucket; yields (members' (endpoint, admin, s3, mirror),
    the models bucket, the data bucket)."""
    tmp = tmp_path_factory.mktemp("models-store")
    run = uuid.uuid4().hex[:8]
    models_bucket, data_bucket = f"tg-models-{run}", f"tg-data-{run}"
    direct = store_client(store)
    direct.create_bucket(Bucket=models_bucket)
    spec = [{"id": f"node-{i}", "s3": f"http://127.0.0.1:{free_port()}", "admin": f"http://127.0.0.1:{free_port()}"}
            for i in range(3)]
    env = {
        "TENSORGATE_BACKEND_ACCESS_KEY": store["access_key"],
        "TENSORGATE_BACKEND_SECRET_KEY": store["secret_key"],
        "TENSORGATE_BACKEND_TRAILING_CHECKSUMS": str(STORE_KIND == "seaweedfs").lower(),
    }
    with contextlib.ExitStack() as stack:
        out = []
        for m in spec:
            mirror = tmp / f"mirror-{m['id']}"
            config = cluster_config(m["id"], spec) + (
                f"[pushdown]\nmodels_refresh_secs = 1\nmax_model_bytes = {MAX_MODEL_BYTES}\n"
                f'[pushdown.models_store]\nbucket = "{models_bucket}"\nprefix = "{PREFIX}"\nmirror_dir = "{mirror}"\n')
            ports = (int(m["s3"].rsplit(":", 1)[1]), int(m["admin"].rsplit(":", 1)[1]))
            endpoint, admin, s3, _ = stack.enter_context(
                run_gateway(tmp, config, seaweed=store["endpoint"], env=env, ports=ports))
            out.append((endpoint, admin, s3, mirror))
        wait_states([m["admin"] for m in spec], ["ready"] * 3)
        s3 = out[0][2]
        s3.create_bucket(Bucket=data_bucket)
        png = io.BytesIO()
        pixels = np.random.default_rng(11).integers(0, 256, (40, 50, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(png, format="PNG")
        s3.put_object(Bucket=data_bucket, Key="img.png", Body=png.getvalue())
        yield out, models_bucket, data_bucket


def names(admin):
    return [m["name"] for m in listing(admin)["models"]]


def doc_commands():
    """The `aws` commands of docs/pushdown.md's "Models" section that add and remove a model."""
    text = (ROOT / "docs" / "pushdown.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text[text.index("## Models"):], re.S)
    return [shlex.split(line) for block in blocks for line in block.splitlines() if "models/tensorgate/" in line]


def test_a_model_in_the_store_is_served_by_every_member_and_removed_from_every_member(store, members, tmp_path):
    nodes, models_bucket, data_bucket = members
    base = features(nodes[0][2], data_bucket, "tiny-cnn")
    # The documented commands, run as written against this store and its bucket.
    add, remove = doc_commands()[:2], doc_commands()[2:]
    assert len(add) == 2 and len(remove) == 1
    (tmp_path / "models" / "my-model").mkdir(parents=True)
    shutil.copy(TINY / "model.onnx", tmp_path / "models" / "my-model" / "model.onnx")
    (tmp_path / "models" / "my-model" / "manifest.toml").write_text(
        (TINY / "manifest.toml").read_text().replace('name = "tiny-cnn"', 'name = "my-model"'))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=store["access_key"], AWS_SECRET_ACCESS_KEY=store["secret_key"],
               AWS_DEFAULT_REGION="us-east-1")

    def run(argv):
        argv = [AWS if a == "aws" else store["endpoint"] if a == "http://127.0.0.1:9000"
                else a.replace("s3://models/", f"s3://{models_bucket}/") for a in argv]
        subprocess.run(argv, cwd=tmp_path, env=env, check=True, capture_output=True)

    for argv in add:
        run(argv)
    for _, admin, s3, mirror in nodes:
        until(lambda: "my-model" in names(admin), f"my-model served by {admin}")
        # The same weights as the bundled model: the same features, on every member.
        np.testing.assert_array_equal(features(s3, data_bucket, "my-model"), base)
        assert (mirror / "my-model" / "model.onnx").read_bytes() == (TINY / "model.onnx").read_bytes()
        assert "my-model" in memory_engines(admin)
    # Each member's cluster report says when every ready member serves the same models.
    for _, admin, _, _ in nodes:
        until(lambda: cluster_report(admin)["models_agree"], f"{admin} reports the members agree")
        digests = {m["models"] for m in cluster_report(admin)["members"]}
        assert len(digests) == 1 and None not in digests, cluster_report(admin)

    for argv in remove:
        run(argv)
    for _, admin, s3, mirror in nodes:
        until(lambda: "my-model" not in names(admin), f"my-model removed from {admin}")
        with pytest.raises(ClientError) as e:
            features(s3, data_bucket, "my-model")
        assert e.value.response["Error"]["Code"] == "InvalidArgument"
        # Its engines stop once their requests are done: their memory is back in the budget.
        until(lambda: "my-model" not in memory_engines(admin), f"my-model's engines gone from {admin}")
        assert not (mirror / "my-model").exists()


def test_hostile_models_in_the_store_are_refused_by_every_member(store, members):
    nodes, models_bucket, data_bucket = members
    direct = store_client(store)
    junk = b"not a model"
    put_model(direct, models_bucket, "bad-hash", lambda m: m.replace('sha256 = "457c', 'sha256 = "000c'))
    put_model(direct, models_bucket, "bad-split", lambda m: m.replace('tensor = "block1"', 'tensor = "nope"'))
    put_model(direct, models_bucket, "junk", lambda m: m.replace(
        "457cb3721b9f12ca56938a5391fd28d099d9a7b26ece9f047cd0ffffeb850b7e", hashlib.sha256(junk).hexdigest()),
        onnx=junk)
    put_model(direct, models_bucket, "huge", onnx=os.urandom(2 * MAX_MODEL_BYTES))
    direct.put_object(Bucket=models_bucket, Key=f"{PREFIX}nested/manifest.toml", Body=b"")
    direct.put_object(Bucket=models_bucket, Key=f"{PREFIX}nested/deeper/model.onnx", Body=b"")
    # A user the store does not let write the bucket cannot add a model to it.
    with pytest.raises(ClientError) as e:
        put_model(store_client(store, alt=True), models_bucket, "intruder")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] in (403, 404), e.value.response
    want = {"bad-hash": "sha256 of", "bad-split": "does not produce", "junk": "not an ONNX model",
            "huge": "more than pushdown.max_model_bytes", "nested": "not a plain file name"}
    base = features(nodes[0][2], data_bucket, "tiny-cnn")
    for _, admin, s3, mirror in nodes:
        until(lambda: set(want) <= {f["dir"] for f in listing(admin)["failed"]}, f"every refusal on {admin}")
        why = {f["dir"]: f["error"] for f in listing(admin)["failed"]}
        for name, reason in want.items():
            assert reason in why[name], (name, why[name])
        # Nothing is served from them, the file over the limit was never fetched, and the rest
        # serves on.
        assert not (set(want) | {"intruder"}) & set(names(admin)), names(admin)
        assert not (mirror / "huge").exists() and not (mirror / ".partial" / "huge").exists()
        np.testing.assert_array_equal(features(s3, data_bucket, "tiny-cnn"), base)
        with pytest.raises(ClientError) as e:
            features(s3, data_bucket, "junk")
        assert e.value.response["Error"]["Code"] == "InvalidArgument"
