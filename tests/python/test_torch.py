"""The Python client as a PyTorch data source, and the loaders users already have, against the real
binary in front of a real SeaweedFS, with the real packages (torch, torchdata, webdataset, s3fs):
a spawn-context multi-worker DataLoader, two ranks covering the data once with equal batch counts,
a StatefulDataLoader resumed mid-epoch equal to the uninterrupted run, a WebDataset pipeline over
presigned `format=tar` URLs bit-equal to the safetensors path, one plan per job, header-less
loaders (s3fs, parallel ranged downloads) through an alias bucket, and the map-style datasets."""

import io
import json
import tarfile
import urllib.request

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from conftest import metric, run_gateway
from test_pushdown import npy_bytes, reference

from tensorgate import Client
from tensorgate.data import MemberDataset, ObjectDataset, ShardDataset
from tensorgate.wds import read_index, write_index

MODEL, SPLIT = "tiny-cnn", "block2"  # block2 is the freeze split; stem needs the suffix here
SIZES = [6, 3, 5, 4, 2]  # uneven shards: 20 samples
BUCKET = "torchdata"
ALIAS = (
    '[[pushdown.aliases]]\nbucket = "torchdata-stem"\ntarget = "torchdata"\nmodel = "tiny-cnn"\nsplit = "stem"\n'
)


def shard(samples) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for key, x, label in samples:
            meta = json.dumps({"key": key}).encode()
            for name, data in ((f"{key}.npy", npy_bytes(x)), (f"{key}.cls", str(label).encode()),
                               (f"{key}.json", meta)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def gw(seaweed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("torch")
    with run_gateway(tmp, ALIAS, seaweed=seaweed) as (endpoint, admin, s3, _):
        client = Client(endpoint, "tensorgate-dev", "tensorgate-dev-secret", admin=admin)
        rng = np.random.default_rng(17)
        data, labels, n = {}, {}, 0
        s3.create_bucket(Bucket=BUCKET)
        for s, size in enumerate(SIZES):
            samples = []
            for _ in range(size):
                key = f"s{n:04d}"
                data[key], labels[key] = rng.random((3, 32, 32), dtype=np.float32), n % 3
                samples.append((key, data[key], labels[key]))
                n += 1
            s3.put_object(Bucket=BUCKET, Key=f"wds/{s:03d}.tar", Body=shard(samples))
            for key, x, _ in samples:
                s3.put_object(Bucket=BUCKET, Key=f"objects/{key}.npy", Body=npy_bytes(x))
        counts = write_index(client, BUCKET, "wds/")
        keys = sorted(data)
        want = dict(zip(keys, reference(MODEL, SPLIT, np.stack([data[k] for k in keys]))))
        yield client, admin, want, labels, counts


def dataset(client, **kw):
    kw.setdefault("prefix", "wds/")
    return ShardDataset(client, BUCKET, MODEL, kw.pop("split", SPLIT), **kw)


def collect(batches):
    keys, feats, labels = [], [], []
    for b in batches:
        keys += list(b["key"])
        feats.append(b["features"].numpy())
        labels.append(b["label"].numpy())
    return keys, np.concatenate(feats), np.concatenate(labels)


def check(keys, feats, labels, want, want_labels):
    np.testing.assert_array_equal(feats, np.stack([want[k] for k in keys]))
    assert labels.tolist() == [want_labels[k] for k in keys]


def test_index_counts_the_samples_of_each_shard(gw):
    client, _, _, _, counts = gw
    assert list(counts.values()) == SIZES
    assert read_index(client, BUCKET, "wds/shards.json") == counts


def test_spawn_workers_yield_every_sample_once_with_the_reference_features(gw):
    client, _, want, want_labels, _ = gw
    ds = dataset(client, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    keys, feats, labels = collect(loader)
    assert sorted(keys) == sorted(want)
    check(keys, feats, labels, want, want_labels)
    assert isinstance(feats, np.ndarray) and feats.dtype == np.float32


def test_two_ranks_cover_the_dataset_once_with_equal_batch_counts(gw):
    client, _, want, want_labels, _ = gw
    for epoch in (0, 1):
        seen, batches = [], []
        for rank in range(2):
            ds = dataset(client, index="wds/shards.json", rank=rank, world_size=2, batch_size=3, shuffle=True,
                         seed=5, shuffle_buffer=4)
            ds.set_epoch(epoch)
            got = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
            assert len(got) == len(ds)
            batches.append(len(got))
            keys, feats, labels = collect(got)
            check(keys, feats, labels, want, want_labels)
            seen.append(keys)
        assert batches[0] == batches[1] == 4, batches  # 10 samples a rank in batches of 3
        assert sorted(seen[0] + seen[1]) == sorted(want)
        if epoch == 0:
            first = seen
    assert first != seen  # the next epoch is another permutation


def test_a_resumed_stateful_loader_continues_exactly_where_it_stopped(gw):
    client, _, want, want_labels, _ = gw

    def loader(**kw):
        ds = dataset(client, batch_size=3, shuffle=True, seed=9, shuffle_buffer=5, counts=gw[4])
        ds.set_epoch(2)
        return StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn", **kw)

    whole = [list(b["key"]) for b in loader()]
    first = loader()
    it = iter(first)
    head = [list(next(it)["key"]) for _ in range(3)]
    state = first.state_dict()
    del it, first
    resumed = loader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    tail = [list(b["key"]) for b in rest]
    assert head + tail == whole
    keys = [k for b in head + tail for k in b]
    assert len(keys) == len(set(keys)) == len(want)
    check(*collect(rest), want, want_labels)


def test_webdataset_pipeline_over_presigned_tar_urls_matches_the_safetensors_path(gw):
    import webdataset as wds

    client, _, want, want_labels, counts = gw
    urls = client.urls(BUCKET, "wds/{000..004}.tar", MODEL, SPLIT)
    assert len(urls) == 5 and all("tensorgate-format=tar" in u for u in urls)
    pipeline = wds.WebDataset(urls, shardshuffle=False, empty_check=False).decode().to_tuple("__key__", "npy", "cls", "json")
    rows = list(pipeline)
    assert [k for k, *_ in rows] == sorted(want)
    for key, feats, label, meta in rows:
        assert feats.dtype == np.float32
        np.testing.assert_array_equal(feats, want[key])
        assert label == want_labels[key] and meta == {"key": key}
    # Bit-equal to the safetensors output of the same shards.
    for s in range(len(SIZES)):
        st = client.features(BUCKET, f"wds/{s:03d}.tar", MODEL, SPLIT)
        np.testing.assert_array_equal(st.features, np.stack([r[1] for r in rows if r[0] in st.keys]))


def test_tar_outputs_are_cached_ranged_and_refused_for_single_objects(gw):
    client, _, want, _, _ = gw
    key = "wds/001.tar"
    full = client.get(BUCKET, key, MODEL, SPLIT, fmt="tar", dtype="f16", raw=True)  # not asked for before
    again = client.get(BUCKET, key, MODEL, SPLIT, fmt="tar", dtype="f16", raw=True)
    assert full.cache == "miss" and again.cache in ("hit", "revalidated") and again.etag == full.etag
    body = full.result.features.tobytes()
    part = client.get(BUCKET, key, MODEL, SPLIT, fmt="tar", dtype="f16", raw=True, range="bytes=512-2047")
    assert part.result.features.tobytes() == body[512:2048]
    decoded = client.get(BUCKET, key, MODEL, SPLIT, fmt="tar", dtype="f16")
    assert decoded.result.keys == ["s0006", "s0007", "s0008"] and decoded.result.features.dtype == np.float16
    np.testing.assert_array_equal(decoded.result.features,
                                  np.stack([want[k] for k in decoded.result.keys]).astype(np.float16))
    with pytest.raises(Exception) as e:
        client.get(BUCKET, "objects/s0000.npy", MODEL, SPLIT, fmt="tar")
    assert "InvalidArgument" in str(e.value)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(client.presign(BUCKET, key, MODEL, SPLIT, fmt="tar").replace(SPLIT, "stem"))
    assert e.value.code == 403  # the trigger parameters are signed


def test_split_auto_is_planned_once_per_job(gw):
    client, admin, want, want_labels, _ = gw
    before = metric(admin, "tensorgate_pushdown_plans_total")
    # No re-planning on bandwidth changes (loopback's rate jumps): exactly one plan is expected.
    ranks = [dataset(client, split="auto", rank=rank, world_size=2, batch_size=4, replan_threshold=float("inf"))
             for rank in range(2)]
    for epoch in range(2):  # workers are started again each epoch (not persistent)
        for ds in ranks:
            ds.set_epoch(epoch)
            keys, feats, labels = collect(DataLoader(ds, batch_size=None, num_workers=2,
                                                     multiprocessing_context="spawn"))
            np.testing.assert_allclose(feats, np.stack([want[k] for k in keys]), rtol=1e-5, atol=1e-5)
            check(keys, np.stack([want[k] for k in keys]), labels, want, want_labels)
    assert metric(admin, "tensorgate_pushdown_plans_total") - before == 1


def test_header_less_loaders_read_features_through_an_alias_bucket(gw):
    import s3fs
    from boto3.s3.transfer import TransferConfig

    client, _, _, _, _ = gw
    direct = client.features(BUCKET, "wds/000.tar", MODEL, "stem")
    fs = s3fs.S3FileSystem(key="tensorgate-dev", secret="tensorgate-dev-secret",
                           client_kwargs={"endpoint_url": client.endpoint, "region_name": "us-east-1"})
    # A listing of an alias carries the outputs' sizes, which s3fs reads files by.
    listed = {o["name"]: o["size"] for o in fs.ls("torchdata-stem/wds/", detail=True)}
    assert listed["torchdata-stem/wds/000.tar"] == client.s3.head_object(Bucket="torchdata-stem", Key="wds/000.tar")["ContentLength"]
    with fs.open("torchdata-stem/wds/000.tar", "rb", block_size=64 << 10) as f:
        head = f.read(100)
        rest = f.read()
    from tensorgate.codec import decode

    via_fs = decode(head + rest)
    np.testing.assert_array_equal(via_fs.features, direct.features)
    # A downloader that starts with a ranged GET of the first part and fetches the rest in
    # parallel ranges (boto3's transfer manager, as aws s3 cp does).
    out = io.BytesIO()
    cfg = TransferConfig(multipart_threshold=64 << 10, multipart_chunksize=64 << 10, max_concurrency=4)
    client.s3.download_fileobj("torchdata-stem", "wds/000.tar", out, Config=cfg)
    assert len(out.getvalue()) > 2 * (64 << 10)  # really several ranges
    np.testing.assert_array_equal(decode(out.getvalue()).features, direct.features)


def test_map_style_datasets_work_with_a_distributed_sampler(gw):
    client, _, want, want_labels, counts = gw
    keys = sorted(want)
    objects = ObjectDataset(client, BUCKET, [f"objects/{k}.npy" for k in keys], MODEL, "stem",
                            labels=[want_labels[k] for k in keys])
    members = MemberDataset(client, BUCKET, MODEL, "stem", index="wds/shards.json")
    assert len(objects) == len(members) == len(want)
    for ds in (objects, members):
        seen = []
        for rank in range(2):
            sampler = DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=3)
            for b in DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context="spawn"):
                idx = [int(k.split("s")[-1].split(".")[0]) for k in b["key"]]
                np.testing.assert_allclose(b["features"].numpy(), np.stack([want[keys[i]] for i in idx]),
                                           rtol=1e-5, atol=1e-5)
                assert b["label"].tolist() == [want_labels[keys[i]] for i in idx]
                seen += idx
        assert sorted(seen) == list(range(len(want)))


def test_without_torch_tensors_the_dataset_yields_numpy(gw):
    client, _, want, want_labels, _ = gw
    ds = dataset(client, tensors="numpy", batch_size=8, keys=["wds/000.tar", "wds/001.tar"])
    batches = list(ds)  # no DataLoader: plain iteration in this process
    assert [len(b["key"]) for b in batches] == [8, 1]
    assert all(isinstance(b["features"], np.ndarray) for b in batches)
    keys = [k for b in batches for k in b["key"]]
    check(keys, np.concatenate([b["features"] for b in batches]), np.concatenate([b["label"] for b in batches]),
          want, want_labels)


def test_loader_history_is_bounded_across_epochs(gw):
    from tensorgate import ShardLoader

    client = gw[0]
    loader = ShardLoader(client, BUCKET, "wds/", MODEL, SPLIT, batch_size=4, history=3)
    for _ in range(3):
        assert sum(len(f) for f, _, _ in loader) == len(gw[2])
    assert len(loader.fetches) == 3 and len(loader.events) == 3
    assert all(f.result is None for f in loader.fetches)  # the history holds no features
    assert loader.bytes_received > 0
