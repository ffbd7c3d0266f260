"""Three gateway processes as one cluster in front of one SeaweedFS (docs/SCALING.md), with the
Python client routing to owners: epoch 2 hits the caches where a client spreading its requests over
the members misses about 2 times in 3; a member killed mid-epoch costs only its own share, with
correct features; a plain boto3 client on any member gets the same tensors as the routed client."""

import contextlib
import json
import os
import random
import signal
import time
import urllib.request

import numpy as np
import pytest

from conftest import free_port, run_gateway
from test_pushdown import npy_bytes, reference
from test_torch import shard

from tensorgate import Client
from tensorgate.cluster import rank, score

MODEL, SPLIT = "tiny-cnn", "block2"
BUCKET, SHARDS, PER_SHARD = "cluster", 24, 2
AK, SK = "tensorgate-dev", "tensorgate-dev-secret"


def cluster_config(node: str, members: list[dict]) -> str:
    rows = ", ".join(f'{{ id = "{m["id"]}", s3 = "{m["s3"]}", admin = "{m["admin"]}" }}' for m in members)
    # No hop secret: every member computes what it is asked, so a client's route decides where a
    # result is cached (the hop itself is tested in integration-tests/tests/it/cluster.rs).
    return f'[cluster]\nnode_id = "{node}"\nmembers = [{rows}]\nrefresh_secs = 1\nprobe_timeout_ms = 500\n'


def cluster_report(admin: str) -> dict:
    with urllib.request.urlopen(f"{admin}/v1/cluster", timeout=5) as r:
        return json.load(r)


def wait_states(admins: list[str], want: list[str], timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    for admin in admins:
        while [m["state"] for m in cluster_report(admin)["members"]] != want:
            assert time.time() < deadline, cluster_report(admin)
            time.sleep(0.1)


@pytest.fixture(scope="module")
def nodes(seaweed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cluster")
    members = [{"id": f"node-{i}", "s3": f"http://127.0.0.1:{free_port()}", "admin": f"http://127.0.0.1:{free_port()}"}
               for i in range(3)]
    with contextlib.ExitStack() as stack:
        procs = []
        for m in members:
            ports = (int(m["s3"].rsplit(":", 1)[1]), int(m["admin"].rsplit(":", 1)[1]))
            procs.append(stack.enter_context(run_gateway(tmp, cluster_config(m["id"], members), seaweed=seaweed,
                                                         ports=ports)))
        wait_states([m["admin"] for m in members], ["ready"] * 3)
        rng = np.random.default_rng(5)
        data, n = {}, 0
        s3 = procs[0][2]
        s3.create_bucket(Bucket=BUCKET)
        for s in range(SHARDS):
            samples = []
            for _ in range(PER_SHARD):
                key = f"c{n:04d}"
                data[key] = rng.random((3, 32, 32), dtype=np.float32)
                samples.append((key, data[key], n % 3))
                n += 1
            s3.put_object(Bucket=BUCKET, Key=f"train/{s:03d}.tar", Body=shard(samples))
        keys = sorted(data)
        want = dict(zip(keys, reference(MODEL, SPLIT, np.stack([data[k] for k in keys]))))
        yield members, procs, want, data


def shards():
    return [f"train/{s:03d}.tar" for s in range(SHARDS)]


def epoch(get, split=SPLIT):
    """(cache statuses, computed-by, features by key) of one pass over the shards."""
    statuses, by, feats = [], [], {}
    for key in shards():
        got = get(key, split)
        statuses.append(got.cache)
        by.append(got.computed_by)
        feats.update(zip(got.result.keys, got.result.features))
    return statuses, by, feats


def hit_rate(statuses):
    return sum(s in ("hit", "revalidated") for s in statuses) / len(statuses)


def test_the_client_computes_the_gateways_rendezvous_order(nodes):
    members = nodes[0]
    ids = [m["id"] for m in members]
    # The gateway's hashing, restated: SHA-256(id NUL bucket NUL key), first 8 bytes big-endian.
    assert score("node-a", "bucket", "key") == int.from_bytes(
        __import__("hashlib").sha256(b"node-a\0bucket\0key").digest()[:8], "big")
    owners = [rank(ids, BUCKET, k)[0] for k in shards()]
    assert len(set(owners)) == 3  # the shards spread over the members
    report = cluster_report(members[0]["admin"])
    assert report["node"] == "node-0" and report["hashing"] == "hrw-sha256-v1"
    assert [m["id"] for m in report["members"]] == ids


def test_owner_routing_keeps_every_cache_warm_where_spreading_misses(nodes):
    members, _, want, _ = nodes
    routed = Client(members[0]["s3"], AK, SK, admin=members[0]["admin"], route=True)
    s1, by1, f1 = epoch(lambda k, s: routed.get(BUCKET, k, MODEL, s))
    s2, by2, f2 = epoch(lambda k, s: routed.get(BUCKET, k, MODEL, s))
    ids = [m["id"] for m in members]
    assert by1 == by2 == [rank(ids, BUCKET, k)[0] for k in shards()]
    assert hit_rate(s1) == 0 and hit_rate(s2) >= 0.95, (s1, s2)
    for f in (f1, f2):
        np.testing.assert_array_equal(np.stack([f[k] for k in sorted(want)]), np.stack([want[k] for k in sorted(want)]))
    # The same client spreading its requests over the members at random (a load balancer), on
    # another split (fresh cache entries): epoch 2 hits only where it lands where epoch 1 did.
    plain = [Client(m["s3"], AK, SK) for m in members]
    pick = random.Random(7)
    spread = lambda k, s: plain[pick.randrange(3)].get(BUCKET, k, MODEL, s)  # noqa: E731
    r1, _, _ = epoch(spread, "stem")
    r2, _, g2 = epoch(spread, "stem")
    assert hit_rate(r1) == 0 and hit_rate(r2) < 0.6, r2
    print(f"epoch-2 hit rate: owner routing {hit_rate(s2):.2f}, spread over 3 members {hit_rate(r2):.2f}")
    # A plain client on one member gets the same tensors as the routed client (any route, same result).
    direct = epoch(lambda k, s: plain[1].get(BUCKET, k, MODEL, s))[2]
    assert all(np.array_equal(direct[k], f2[k]) for k in want)


def test_a_member_killed_mid_epoch_costs_only_its_share(nodes):
    members, procs, _, data = nodes
    keys = sorted(data)
    want = dict(zip(keys, reference(MODEL, "block1", np.stack([data[k] for k in keys]))))
    routed = Client(members[0]["s3"], AK, SK, admin=members[0]["admin"], route=True)
    epoch(lambda k, s: routed.get(BUCKET, k, MODEL, s), "block1")  # warm every owner's cache
    ids = [m["id"] for m in members]
    owners = [rank(ids, BUCKET, k)[0] for k in shards()]
    half = SHARDS // 2
    statuses, by, feats = [], [], {}
    for i, key in enumerate(shards()):
        if i == half:
            os.kill(procs[2][3], signal.SIGKILL)  # node-2's process, mid-epoch
        got = routed.get(BUCKET, key, MODEL, "block1")
        statuses.append(got.cache)
        by.append(got.computed_by)
        feats.update(zip(got.result.keys, got.result.features))
    assert len(feats) == len(want)
    for k, f in feats.items():
        np.testing.assert_allclose(f, want[k], rtol=1e-5, atol=1e-5)
    lost = [i for i in range(half, SHARDS) if owners[i] == "node-2"]
    misses = [i for i, s in enumerate(statuses) if s == "miss"]
    assert misses == lost, (misses, lost)  # only node-2's remaining share was computed again
    assert all(by[i] != "node-2" for i in lost)
    assert all(by[i] == owners[i] for i in range(SHARDS) if i not in lost)
