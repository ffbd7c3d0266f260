"""Augmented pushdown (ADR 0032): `RandomResizedCrop` and `RandomHorizontalFlip` drawn per sample
from a seed, computed by the gateway, against the independent reference: the Python client's
draws (`tensorgate.augment`), torchvision's v2 functional `resized_crop` (bilinear, antialiased)
and `horizontal_flip` on the PIL image, numpy normalisation and onnxruntime on the prefix."""

import io

import botocore.exceptions
import numpy as np
import pytest
import tomllib
from conftest import CLIENT_AK, CLIENT_SK, ROOT, metric
from PIL import Image
from test_pushdown import pushdown_get, reference, rel_l2, synthetic_photo, tar_of

from tensorgate.augment import Augment, Drawn
from tensorgate.codec import decode

MODEL = "tiny-cnn"
SPLITS = ("stem", "pool")  # a spatial split and a pooled one
SEEDS = (0, 1, 7, 2**63 + 5, 2**64 - 1)
# The contract (both formats: the gateway's JPEG decoder and PIL's agree here to the bit, and
# so the features did at every sample and seed when this was written).
BOUND = 1e-5


def images() -> list[tuple[str, bytes, str]]:
    """(key, bytes, format): 200 images, 64 to 2000 pixels a side, tall, wide and square, JPEG and
    PNG, in several colour modes."""
    sizes = [(64, 64), (64, 2000), (2000, 64), (500, 375), (375, 500), (1999, 1501), (97, 131), (640, 480),
             (64, 300), (301, 64), (1024, 1024), (77, 64)]  # fmt: skip
    sizes += [(w + 13 * j, h + 7 * j) for j in range(1, 4) for w, h in sizes if max(w, h) < 1000]
    sizes += [(64 + 37 * j % 437, 64 + 53 * j % 389) for j in range(200 - len(sizes))]
    modes = ["RGB", "L", "RGBA", "P", "RGB", "CMYK"]
    out = []
    for i, (w, h) in enumerate(sizes):
        fmt = "PNG" if i % 2 else "JPEG"
        mode = modes[i % len(modes)]
        if fmt == "JPEG" and mode in ("RGBA", "P"):
            mode = "RGB"
        if fmt == "PNG" and mode == "CMYK":
            mode = "L"
        img = synthetic_photo(w, h, seed=i)
        img = img.quantize(200) if mode == "P" else img.convert(mode)
        buf = io.BytesIO()
        img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        out.append((f"s{i:03d}", buf.getvalue(), fmt))
    return out


def manifest() -> dict:
    return tomllib.loads((ROOT / "models" / MODEL / "manifest.toml").read_text())


def reference_input(data: bytes, aug: Augment, key: str) -> tuple[np.ndarray, Drawn]:
    """The reference pipeline: PIL's RGB image, the client's draw applied by torchvision's
    functional ops, normalised."""
    from torchvision.transforms.v2 import functional as F

    p = manifest()["preprocess"]
    img = Image.open(io.BytesIO(data)).convert("RGB")
    drawn = aug.draw(key, img.width, img.height)
    top, left, h, w = drawn.box
    img = F.resized_crop(img, top, left, h, w, list(p["crop"]), antialias=True)
    if drawn.flip:
        img = F.horizontal_flip(img)
    a = np.asarray(img, dtype=np.float32)
    a = (a * np.float32(p["scale"]) - np.array(p["mean"], np.float32)) / np.array(p["std"], np.float32)
    return a.transpose(2, 0, 1), drawn


@pytest.fixture(scope="module")
def shard(s3_module):
    s3, bucket = s3_module
    imgs = images()
    members = [(f"{k}.{'png' if f == 'PNG' else 'jpg'}", d) for k, d, f in imgs]
    s3.put_object(Bucket=bucket, Key="aug/train-0.tar", Body=tar_of(members))
    for k, d, f in imgs:
        s3.put_object(Bucket=bucket, Key=f"aug/{k}.img", Body=d)
    return imgs


@pytest.fixture(scope="module")
def s3_module(gateway):
    """A client and a bucket for the module (the images are put once)."""
    import time

    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=gateway[0], aws_access_key_id=CLIENT_AK, aws_secret_access_key=CLIENT_SK,
                      region_name="us-east-1",
                      config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
    bucket = f"augment-{int(time.time() * 1000) % 10**9}"
    s3.create_bucket(Bucket=bucket)
    return s3, bucket


@pytest.mark.parametrize("seed", SEEDS)
def test_a_shards_augmented_features_equal_the_reference(s3_module, shard, seed):
    """One shard of every size and mode, five seeds: per sample, the features at a spatial and a
    pooled split equal the reference's computed with the client's own draws."""
    s3, bucket = s3_module
    aug = Augment(seed=seed)
    by_key = {k: (d, f) for k, d, f in shard}
    for split in SPLITS:
        got = pushdown_get(s3, bucket, "aug/train-0.tar", model=MODEL, split=split, **aug.fields())
        feats = decode(got["Body"].read())
        assert feats.keys == [k for k, _, _ in shard]
        refs = [reference_input(by_key[k][0], aug, k) for k in feats.keys]
        assert feats.augmented == [drawn for _, drawn in refs], "each sample's draw is returned and the client's"
        x = np.stack([x for x, _ in refs])
        want = reference(MODEL, split, x)
        worst = {"PNG": 0.0, "JPEG": 0.0}
        for i, k in enumerate(feats.keys):
            err, fmt = rel_l2(feats.features[i], want[i]), by_key[k][1]
            worst[fmt] = max(worst[fmt], err)
            assert err <= BOUND, f"{k} ({fmt}) seed {seed} {split}: rel L2 {err:.2e}"
        print(f"seed {seed} {split}: worst rel L2 PNG {worst['PNG']:.1e}, JPEG {worst['JPEG']:.1e}")


def test_a_tar_output_carries_each_samples_draw_beside_its_features(s3_module, shard):
    """`format=tar`: each sample's `.augmented` member holds its draw, the client's again."""
    from tensorgate.wds import decode_features

    s3, bucket = s3_module
    aug = Augment(seed=8)
    got = pushdown_get(s3, bucket, "aug/train-0.tar", model=MODEL, split="pool", format="tar", **aug.fields())
    body = got["Body"].read()
    assert int(got["ResponseMetadata"]["HTTPHeaders"]["content-length"]) == len(body)
    feats = decode_features(body)
    by_key = {k: d for k, d, _ in shard}
    refs = [reference_input(by_key[k], aug, k) for k in feats.keys]
    assert feats.augmented == [drawn for _, drawn in refs]
    want = reference(MODEL, "pool", np.stack([x for x, _ in refs]))
    assert max(rel_l2(feats.features[i], want[i]) for i in range(len(refs))) <= BOUND


def test_a_single_images_draw_comes_back_and_equals_the_clients(s3_module, shard):
    """A single image draws from its object key; `x-tensorgate-augmented` says what it drew, the
    client's function draws the same box and flip, and the features equal the reference's."""
    s3, bucket = s3_module
    flips = 0
    for seed in SEEDS[:3]:
        aug = Augment(seed=seed)
        for k, data, fmt in shard[:36]:  # every size and mode
            key = f"aug/{k}.img"
            got = pushdown_get(s3, bucket, key, model=MODEL, split="pool", **aug.fields())
            x, drawn = reference_input(data, aug, key)
            assert Drawn.parse(got["ResponseMetadata"]["HTTPHeaders"]["x-tensorgate-augmented"]) == drawn, key
            flips += drawn.flip
            err = rel_l2(np.load(io.BytesIO(got["Body"].read())), reference(MODEL, "pool", x[None])[0])
            assert err <= BOUND, f"{key} seed {seed}: rel L2 {err:.2e}"
    assert 0 < flips < 3 * 36, "some samples flip, some do not"


def test_flip_only_follows_the_evaluation_transform(s3_module, shard):
    """`RandomHorizontalFlip` alone flips the manifest's resize and centre crop."""
    from test_pushdown import reference_preprocess

    s3, bucket = s3_module
    aug = Augment(seed=3, crop=False, flip=1.0)
    k, data, _ = next(s for s in shard if s[2] == "PNG")
    got = pushdown_get(s3, bucket, f"aug/{k}.img", model=MODEL, split="stem", **aug.fields())
    assert got["ResponseMetadata"]["HTTPHeaders"]["x-tensorgate-augmented"] == ",,,,1"
    x = reference_preprocess(Image.open(io.BytesIO(data)), MODEL)[..., ::-1].copy()
    assert rel_l2(np.load(io.BytesIO(got["Body"].read())), reference(MODEL, "stem", x[None])[0]) <= 1e-5


def test_an_augmented_output_is_cached_only_when_its_request_repeats(gateway, s3_module, shard):
    """Each epoch draws anew, so a first augmented request is answered uncached (nothing enters
    the cache); the same request again (a retry, a second reader of the seed) is cached, and a
    third is served from there. Another seed is another output."""
    s3, bucket = s3_module
    key = f"aug/{shard[3][0]}.img"
    resident = 'tensorgate_cache_resident_bytes{tier="memory"}'
    before = metric(gateway[1], resident)
    first = pushdown_get(s3, bucket, key, model=MODEL, split="pool", **Augment(seed=11).fields())
    assert metric(gateway[1], resident) == before, "a first augmented output is not cached"
    again = pushdown_get(s3, bucket, key, model=MODEL, split="pool", **Augment(seed=11).fields())
    assert metric(gateway[1], resident) > before, "its repeat is"
    third = pushdown_get(s3, bucket, key, model=MODEL, split="pool", **Augment(seed=11).fields())
    other = pushdown_get(s3, bucket, key, model=MODEL, split="pool", **Augment(seed=12).fields())
    h = [r["ResponseMetadata"]["HTTPHeaders"] for r in (first, again, third, other)]
    # `revalidated` where the store decides who reads (the cached output, after its say).
    assert [x["x-tensorgate-cache"] in ("hit", "revalidated") for x in h] == [False, False, True, False]
    assert h[0]["x-tensorgate-augmented"] == h[1]["x-tensorgate-augmented"] == h[2]["x-tensorgate-augmented"]
    assert h[0]["x-tensorgate-augmented"] != h[3]["x-tensorgate-augmented"]
    assert h[0]["etag"] == h[2]["etag"] != h[3]["etag"]
    plain = pushdown_get(s3, bucket, key, model=MODEL, split="pool")
    assert "x-tensorgate-augmented" not in plain["ResponseMetadata"]["HTTPHeaders"]


def test_epochs_draw_anew_and_the_same_epoch_draws_the_same():
    aug = Augment(seed=5)
    e1, e1_again, e2 = aug.for_epoch(1), Augment(seed=5).for_epoch(1), aug.for_epoch(2)
    assert e1 == e1_again and e1.seed != e2.seed != aug.seed
    boxes = [(e1.draw(f"k{i}", 500, 375), e2.draw(f"k{i}", 500, 375)) for i in range(20)]
    assert sum(a != b for a, b in boxes) >= 18


@pytest.mark.parametrize("fields", [
    {"augment": "RandomResizedCrop(scale=0.5:1.5)", "seed": "1"},
    {"augment": "RandomResizedCrop(ratio=0:2)", "seed": "1"},
    {"augment": "RandomResizedCrop(size=100000)", "seed": "1"},
    {"augment": "RandomResizedCrop(size=224)", "seed": "1"},  # not tiny-cnn's 32 x 32 input
    {"augment": "RandomHorizontalFlip(p=2)", "seed": "1"},
    {"augment": "RandomResizedCrop", "seed": "one"},
    {"augment": "RandomResizedCrop", "seed": "-3"},
    {"augment": "RandomResizedCrop"},
    {"seed": "1"},
    {"augment": "GaussianBlur", "seed": "1"},
])  # fmt: skip
def test_hostile_augmentations_are_a_clear_400_with_nothing_computed(gateway, s3_module, shard, fields):
    s3, bucket = s3_module
    misses = metric(gateway[1], "tensorgate_cache_misses_total")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        pushdown_get(s3, bucket, "aug/train-0.tar", model=MODEL, split="pool", **fields)
    err = e.value.response
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert err["Error"]["Code"] == "InvalidArgument"
    assert metric(gateway[1], "tensorgate_cache_misses_total") == misses, "nothing computed"


def test_tensors_are_not_augmented(s3_module):
    from test_pushdown import npy_bytes

    s3, bucket = s3_module
    s3.put_object(Bucket=bucket, Key="aug/x.npy", Body=npy_bytes(np.zeros((3, 32, 32), np.float32)))
    with pytest.raises(botocore.exceptions.ClientError) as e:
        pushdown_get(s3, bucket, "aug/x.npy", model=MODEL, split="pool", **Augment(seed=1).fields())
    assert e.value.response["Error"]["Code"] == "InvalidArgument"


def test_a_parquet_files_rows_draw_from_their_keys_across_row_groups(s3_module, shard):
    """A Hugging Face style Parquet file of three row groups: each row draws from its key (the
    image's `path`), whichever group it is in, and its features equal the reference's."""
    import pyarrow.parquet as pq
    from test_parquet import hf_table, parquet_bytes

    s3, bucket = s3_module
    imgs = shard[:9]
    data = parquet_bytes(hf_table([d for _, d, _ in imgs], list(range(len(imgs)))), row_group_size=3)
    assert pq.ParquetFile(io.BytesIO(data)).metadata.num_row_groups == 3
    s3.put_object(Bucket=bucket, Key="aug/train.parquet", Body=data)
    aug = Augment(seed=99)
    got = pushdown_get(s3, bucket, "aug/train.parquet", model=MODEL, split="stem", **aug.fields())
    feats = decode(got["Body"].read())
    keys = [f"train/{i:05d}.jpg" for i in range(len(imgs))]
    assert feats.keys == keys
    refs = [reference_input(d, aug, k) for (_, d, _), k in zip(imgs, keys)]
    assert feats.augmented == [drawn for _, drawn in refs]
    want = reference(MODEL, "stem", np.stack([x for x, _ in refs]))
    assert max(rel_l2(feats.features[i], want[i]) for i in range(len(imgs))) <= BOUND
