"""Models added, replaced and removed while the gateway serves (in front of SeaweedFS): a model
copied into `models_dir` is served within the rescan period, a replaced one never answers with
the old version's outputs, a removed one takes no new request and its engines' memory returns to
the budget; hostile model directories are refused and the rest keeps serving."""

import io
import json
import shutil
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from botocore.exceptions import ClientError
from PIL import Image

from conftest import ROOT, metric, run_gateway
from test_pushdown import pushdown_get
from test_reload import client, proof

TINY = ROOT / "models" / "tiny-cnn"


def add_model(models, dir_name: str, name: str, edit=lambda m: m):
    to = models / dir_name
    to.mkdir()
    shutil.copy(TINY / "model.onnx", to / "model.onnx")
    manifest = (TINY / "manifest.toml").read_text().replace('name = "tiny-cnn"', f'name = "{name}"')
    # The manifest last: a rescan reads a model once its manifest is there.
    (to / "manifest.toml").write_text(edit(manifest))


def listing(admin: str) -> dict:
    with urllib.request.urlopen(f"{admin}/v1/models") as r:
        return json.loads(r.read())


def until(check, what: str):
    """Polls `check` (at most 100 looks, 0.1 s apart) until it holds."""
    for _ in range(100):
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"never: {what}")


def features(s3, name: str, bucket: str = "models") -> np.ndarray:
    body = pushdown_get(s3, bucket, "img.png", model=name, split="pool")["Body"].read()
    return np.load(io.BytesIO(body))


def test_models_change_while_serving(tmp_path, seaweed):
    models = tmp_path / "models"
    models.mkdir()
    add_model(models, "tiny", "tiny-cnn")
    env = {"TENSORGATE_MODELS_DIR": str(models), "TENSORGATE__PUSHDOWN__MODELS_REFRESH_SECS": "1"}
    with run_gateway(tmp_path, seaweed=seaweed, env=env) as (endpoint, admin, s3, pid):
        s3.create_bucket(Bucket="models")
        png = io.BytesIO()
        # Noise: resizing it to another size changes what the crop sees.
        pixels = np.random.default_rng(7).integers(0, 256, (40, 50, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(png, format="PNG")
        s3.put_object(Bucket="models", Key="img.png", Body=png.getvalue())
        base = features(s3, "tiny-cnn")
        with pytest.raises(ClientError) as e:
            features(s3, "tiny-two")
        assert e.value.response["Error"]["Code"] == "InvalidArgument"

        # Added: served within the rescan period, the same outputs as the model it copies.
        add_model(models, "two", "tiny-two")
        until(lambda: any(m["name"] == "tiny-two" for m in listing(admin)["models"]), "tiny-two listed")
        np.testing.assert_array_equal(features(s3, "tiny-two"), base)
        assert metric(admin, 'tensorgate_pushdown_model_changes_total{change="added"}') == 1

        # Replaced under the same name with other preprocessing: the new version's outputs, never
        # the old one's (its cached output included).
        before = listing(admin)["models"]
        version = next(m["version"] for m in before if m["name"] == "tiny-two")
        manifest = models / "two" / "manifest.toml"
        manifest.write_text(manifest.read_text().replace("resize_shorter = 36", "resize_shorter = 48"))
        until(lambda: any(m["name"] == "tiny-two" and m["version"] != version for m in listing(admin)["models"]),
              "tiny-two replaced")
        replaced = features(s3, "tiny-two")
        assert replaced.shape == base.shape and not np.array_equal(replaced, base)

        # Removed: no new request; its engines stop and their memory returns to the budget.
        with urllib.request.urlopen(f"{admin}/v1/memory") as r:
            assert any(e["model"] == "tiny-two" for e in json.loads(r.read())["engines"])
        shutil.rmtree(models / "two")
        until(lambda: all(m["name"] != "tiny-two" for m in listing(admin)["models"]), "tiny-two removed")
        with pytest.raises(ClientError) as e:
            features(s3, "tiny-two")
        assert e.value.response["Error"]["Code"] == "InvalidArgument"
        with urllib.request.urlopen(f"{admin}/v1/memory") as r:
            assert all(e["model"] != "tiny-two" for e in json.loads(r.read())["engines"])
        assert metric(admin, 'tensorgate_pushdown_engine_evictions_total{reason="retired"}') >= 1

        # Hostile: a hash that does not match, a file that is not ONNX, a split naming a tensor
        # the graph lacks, a 10 GB file: each refused and listed with why; the rest serves on.
        add_model(models, "hash", "bad-hash", lambda m: m.replace('sha256 = "457c', 'sha256 = "000c'))
        add_model(models, "split", "bad-split", lambda m: m.replace('tensor = "block1"', 'tensor = "nope"'))
        add_model(models, "junk", "junk")
        (models / "junk" / "model.onnx").write_bytes(b"not a model")
        add_model(models, "huge", "huge")
        with open(models / "huge" / "model.onnx", "r+b") as f:
            f.truncate(10 << 30)
        until(lambda: len(listing(admin)["failed"]) == 4, "four refusals")
        why = {f["dir"]: f["error"] for f in listing(admin)["failed"]}
        assert "sha256 of" in why["hash"] and "does not produce" in why["split"]
        assert "sha256 of" in why["junk"] and "max_model_bytes" in why["huge"], why
        assert [m["name"] for m in listing(admin)["models"]] == ["tiny-cnn"]
        np.testing.assert_array_equal(features(s3, "tiny-cnn"), base)
        assert metric(admin, 'tensorgate_pushdown_model_changes_total{change="refused"}') == 4

        # A rescan on demand needs a client's proof.
        req = urllib.request.Request(f"{admin}/v1/models/refresh", method="POST", data=b"")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req)
        assert e.value.code == 403
        req = urllib.request.Request(f"{admin}/v1/models/refresh", method="POST", data=b"",
                                     headers={"x-tensorgate-proof": proof(client(endpoint, "tensorgate-dev",
                                                                                 "tensorgate-dev-secret"))})
        with urllib.request.urlopen(req) as r:
            assert json.loads(r.read()) == {"added": [], "replaced": [], "removed": []}


def test_a_request_for_a_model_just_added_reads_the_directory_again(tmp_path, seaweed):
    models = tmp_path / "models"
    models.mkdir()
    add_model(models, "tiny", "tiny-cnn")
    # No periodic rescan: only the request for the new model can make the gateway see it.
    env = {"TENSORGATE_MODELS_DIR": str(models), "TENSORGATE__PUSHDOWN__MODELS_REFRESH_SECS": "0"}
    with run_gateway(tmp_path, seaweed=seaweed, env=env) as (endpoint, admin, s3, pid):
        s3.create_bucket(Bucket="models-new")
        pixels = np.random.default_rng(3).integers(0, 256, (40, 50, 3), dtype=np.uint8)
        png = io.BytesIO()
        Image.fromarray(pixels).save(png, format="PNG")
        s3.put_object(Bucket="models-new", Key="img.png", Body=png.getvalue())
        base = features(s3, "tiny-cnn", "models-new")
        add_model(models, "three", "tiny-three")
        # More than a second after start (at most one rescan a second for unknown names).
        time.sleep(1.1)
        np.testing.assert_array_equal(features(s3, "tiny-three", "models-new"), base)
        assert metric(admin, 'tensorgate_pushdown_model_changes_total{change="added"}') == 1
