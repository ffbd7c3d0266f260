"""Augmented epochs through the PyTorch datasets (ADR 0032), against the real binary in front of
a real SeaweedFS: two ranks of spawn workers see each sample once per epoch, drawn as the client's
function draws it (features equal to PIL + onnxruntime on those draws); each epoch draws anew; the
no-pushdown baseline (`split="none"`, the raw shards decoded and augmented here) gives the same
features; a resumed epoch continues with the same draws; the map-style dataset too; a cluster
member forwards an augmented read to the object's owner, which draws the same."""

import io

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from conftest import free_port, run_gateway
from test_pushdown import reference, synthetic_photo, tar_of

from tensorgate import Augment, Client
from tensorgate.data import ObjectDataset, ShardDataset
from tensorgate.suffix import preprocess

MODEL, SPLIT = "tiny-cnn", "block2"  # the freeze split: the datasets yield features there
BUCKET = "augtorch"
SIZES = [5, 3, 4, 4]  # 16 samples
AUG = Augment(seed=2024)


def jpeg(i: int) -> bytes:
    buf = io.BytesIO()
    synthetic_photo(90 + 17 * (i % 7), 70 + 23 * (i % 5), seed=i).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def shard(samples) -> bytes:
    return tar_of([member for key, img, label in samples
                   for member in ((f"{key}.jpg", img), (f"{key}.cls", str(label).encode()))])


@pytest.fixture(scope="module")
def gw(seaweed, tmp_path_factory):
    with run_gateway(tmp_path_factory.mktemp("augtorch"), "", seaweed=seaweed) as (endpoint, admin, s3, _):
        client = Client(endpoint, "tensorgate-dev", "tensorgate-dev-secret", admin=admin)
        s3.create_bucket(Bucket=BUCKET)
        images, n = {}, 0
        for s, size in enumerate(SIZES):
            samples = []
            for _ in range(size):
                key = f"s{n:04d}"
                images[key] = jpeg(n)
                samples.append((key, images[key], n % 3))
                s3.put_object(Bucket=BUCKET, Key=f"objects/{key}.jpg", Body=images[key])
                n += 1
            s3.put_object(Bucket=BUCKET, Key=f"wds/{s:03d}.tar", Body=shard(samples))
        yield client, images


def want(client, images: dict, aug: Augment, keys: dict) -> dict:
    """The reference features of each sample under `aug`: the client's draw applied with PIL, the
    manifest's normalisation, onnxruntime up to the split. `keys` maps a sample to the key it
    draws with."""
    info = client.models()[MODEL]
    names = sorted(images)
    x = np.stack([preprocess(images[k], info, aug, keys[k]) for k in names])
    return dict(zip(names, reference(MODEL, SPLIT, x)))


def rows(batches) -> dict:
    out = {}
    for b in batches:
        for k, f in zip(b["key"], b["features"].numpy()):
            assert k not in out, f"{k} twice in one epoch"
            out[k] = f
    return out


def close(got: dict, ref: dict) -> None:
    assert sorted(got) == sorted(ref)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-5, err_msg=k)


def test_two_ranks_of_workers_draw_as_the_client_and_each_epoch_anew(gw):
    client, images = gw
    by_key = {k: k for k in images}
    epochs = []
    for epoch in (0, 1):
        seen = {}
        for rank in range(2):
            ds = ShardDataset(client, BUCKET, MODEL, SPLIT, prefix="wds/", rank=rank, world_size=2, batch_size=2,
                              shuffle=True, seed=5, augment=AUG)
            ds.set_epoch(epoch)
            got = rows(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn"))
            assert not set(got) & set(seen), "the ranks share no sample"
            seen.update(got)
        close(seen, want(client, images, AUG.for_epoch(epoch), by_key))
        epochs.append(seen)
    differ = [k for k in images if not np.allclose(epochs[0][k], epochs[1][k])]
    assert len(differ) >= len(images) - 1, "each epoch draws anew"

    baseline = ShardDataset(client, BUCKET, MODEL, "none", prefix="wds/", batch_size=4, augment=AUG)
    baseline.set_epoch(1)
    close(rows(DataLoader(baseline, batch_size=None)), epochs[1])


def test_a_resumed_augmented_epoch_continues_with_the_same_draws(gw):
    client, images = gw

    def loader():
        ds = ShardDataset(client, BUCKET, MODEL, SPLIT, prefix="wds/", batch_size=2, shuffle=True, seed=9,
                          shuffle_buffer=3, counts=dict(zip([f"wds/{s:03d}.tar" for s in range(4)], SIZES)),
                          augment=AUG)
        ds.set_epoch(3)
        return StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")

    whole = list(loader())
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = first.state_dict()
    del it, first
    resumed = loader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [list(b["key"]) for b in head + rest] == [list(b["key"]) for b in whole]
    for a, b in zip(head + rest, whole):
        np.testing.assert_array_equal(a["features"].numpy(), b["features"].numpy())
    close(rows(whole), want(client, images, AUG.for_epoch(3), {k: k for k in images}))


def test_the_map_style_dataset_draws_by_object_key_per_epoch(gw):
    client, images = gw
    keys = sorted(images)
    ds = ObjectDataset(client, BUCKET, [f"objects/{k}.jpg" for k in keys], MODEL, SPLIT, augment=AUG)
    by_object = {k: f"objects/{k}.jpg" for k in keys}
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        got = {}
        for b in DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="spawn"):
            for k, f in zip(b["key"], b["features"].numpy()):
                got[k.split("/")[-1].split(".")[0]] = f
        close(got, want(client, images, AUG.for_epoch(epoch), by_object))


def test_a_member_forwards_an_augmented_read_to_the_owner_which_draws_the_same(seaweed, gw, tmp_path):
    """Two members with a hop secret: an augmented read through the member that does not own the
    object is computed by its owner with the same fields, drawing what the client draws."""
    import contextlib

    from test_cluster import cluster_config, wait_states

    from tensorgate.cluster import rank

    client, images = gw
    members = [{"id": f"aug-{i}", "s3": f"http://127.0.0.1:{free_port()}", "admin": f"http://127.0.0.1:{free_port()}"}
               for i in range(2)]
    key = "objects/s0003.jpg"
    owner = rank([m["id"] for m in members], BUCKET, key)[0]
    with contextlib.ExitStack() as stack:
        for m in members:
            ports = (int(m["s3"].rsplit(":", 1)[1]), int(m["admin"].rsplit(":", 1)[1]))
            config = cluster_config(m["id"], members) + 'secret_key = "augment-hop-secret-7d1e"\n'
            stack.enter_context(run_gateway(tmp_path, config, seaweed=seaweed, ports=ports))
        wait_states([m["admin"] for m in members], ["ready"] * 2)
        other = next(m for m in members if m["id"] != owner)
        aug = AUG.for_epoch(7)
        got = Client(other["s3"], "tensorgate-dev", "tensorgate-dev-secret").get(BUCKET, key, MODEL, "stem",
                                                                                 augment=aug)
        assert got.computed_by == owner
        info = client.models()[MODEL]
        x = preprocess(images["s0003"], info, aug, key)
        assert got.augmented == aug.draw(key, *Image.open(io.BytesIO(images["s0003"])).size)
        np.testing.assert_allclose(got.result.features, reference(MODEL, "stem", x[None])[0], rtol=1e-5, atol=1e-5)
