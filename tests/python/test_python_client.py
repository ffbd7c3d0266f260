"""The compute-tier client (clients/python) against a real gateway: batches complete and in order,
the overlap really overlaps, sharding covers every sample once, the suffix finishes the frozen
layers, the planner picks the obvious split on constructed profiles (and split=auto follows it),
and the fine-tune example reaches the same accuracy with and without pushdown."""

import io
import json
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import numpy as np
import pytest

from conftest import BINARY, ROOT, run_gateway
from test_pushdown import npy_bytes, reference

from tensorgate import Client, ShardLoader

MODEL = "tiny-cnn"  # freeze split: block2


def shard(samples, first_key: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i, (x, label) in enumerate(samples):
            for name, data in ((f"k{first_key + i:04d}.npy", npy_bytes(x)), (f"k{first_key + i:04d}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("client")
    with run_gateway(tmp, "") as (endpoint, admin, s3, _):
        client = Client(endpoint, "tensorgate-dev", "tensorgate-dev-secret", admin=admin)
        rng = np.random.default_rng(3)
        data = {}
        s3.create_bucket(Bucket="shards")
        # 7 shards of 4 samples each: 28 samples, keys k0000..k0027.
        for s in range(7):
            samples = [(rng.random((3, 32, 32), dtype=np.float32), (4 * s + i) % 3) for i in range(4)]
            for i, (x, _) in enumerate(samples):
                data[f"k{4 * s + i:04d}"] = x
            s3.put_object(Bucket="shards", Key=f"train/{s:03d}.tar", Body=shard(samples, 4 * s))
        yield client, admin, data


def test_batches_arrive_complete_in_order_with_the_freeze_features(gw):
    client, _, data = gw
    loader = ShardLoader(client, "shards", "train/", MODEL, "block2", batch_size=5)
    batches = list(loader)
    assert [len(f) for f, _, _ in batches] == [5, 5, 5, 5, 5, 3]
    keys = [k for _, _, ks in batches for k in ks]
    assert keys == sorted(data)
    labels = np.concatenate([l for _, l, _ in batches])
    assert labels.tolist() == [i % 3 for i in range(28)]
    feats = np.concatenate([f for f, _, _ in batches])
    want = reference(MODEL, "block2", np.stack([data[k] for k in keys]))
    np.testing.assert_array_equal(feats, want)


def test_the_suffix_finishes_the_frozen_layers_from_an_earlier_split(gw):
    client, _, data = gw
    early = np.concatenate([f for f, _, _ in ShardLoader(client, "shards", "train/", MODEL, "stem", batch_size=8)])
    late = np.concatenate([f for f, _, _ in ShardLoader(client, "shards", "train/", MODEL, "block2", batch_size=8)])
    assert early.shape == late.shape
    np.testing.assert_allclose(early, late, rtol=1e-5, atol=1e-5)


def test_sharding_covers_every_sample_exactly_once(gw):
    client, _, data = gw
    seen = []
    for rank in range(3):
        for _, _, keys in ShardLoader(client, "shards", "train/", MODEL, "block2", batch_size=4, rank=rank, world_size=3):
            seen += keys
    assert sorted(seen) == sorted(data) and len(seen) == len(set(seen))


def test_a_numpy_caller_never_imports_torch(gw):
    # torch takes a second or more to import: a loader used without it (a numpy trainer) must not
    # pay that inside its first epoch. Where torch is loaded, ranks come from its process group.
    client, admin, data = gw
    c = client.config
    script = (
        "import sys\n"
        "from tensorgate import Client, ShardLoader\n"
        f"client = Client({c.endpoint!r}, {c.access_key!r}, {c.secret_key!r}, admin={admin!r})\n"
        f"loader = ShardLoader(client, 'shards', 'train/', {MODEL!r}, 'auto', batch_size=4)\n"
        "n = sum(len(f) for f, _, _ in loader)\n"
        "print(n, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split() == [str(len(data)), "False"]


def test_the_next_shard_is_fetched_while_a_slow_step_trains(gw):
    """Each training step waits, without pulling from the loader, until the next shard has
    arrived: only a loader that fetches ahead, during the step, lets it finish (events, not
    timings; the bound only keeps a broken loader from hanging the test)."""
    client, _, _ = gw
    loader = ShardLoader(client, "shards", "train/", MODEL, "block2", batch_size=4, prefetch=2)
    shards = len(client.list_keys("shards", "train/", ".tar"))
    steps = 0
    for _ in loader:  # one batch of 4 per shard
        arrived = lambda: any(k == "fetch_end" and i == steps + 1 for k, i, _ in list(loader.events))  # noqa: E731
        deadline = time.monotonic() + 120
        while steps + 1 < shards and not arrived():  # a slow training step, in events
            assert time.monotonic() < deadline, f"shard {steps + 1} was not fetched during step {steps}"
            time.sleep(0.01)
        steps += 1
    assert steps == shards > 1


def test_the_loader_sends_its_prefetched_requests_in_shard_order(gw):
    """Requests fetched `prefetch` ahead go out in shard order (each waits for the one before it
    to be signed and on its way), whatever order the loader's threads run in: the gateway computes
    a tenant's requests in the order they arrive, and the loader reads them in shard order."""
    client, _, _ = gw
    loader = ShardLoader(client, "shards", "train/", MODEL, "block2", batch_size=4, prefetch=4)
    sent, get = [], client.get

    def recording(bucket, key, *args, before_send=None, **kw):
        def hook():
            sent.append(key)
            before_send()
        # The later shards' threads are let go first: without the loader's ordering they send first.
        time.sleep(0.05 * (6 - int(key.rsplit("/", 1)[1].split(".")[0])) if key.endswith(".tar") else 0)
        return get(bucket, key, *args, before_send=hook, **kw)

    client.get = recording
    try:
        keys = [k for _, _, ks in loader for k in ks]
    finally:
        del client.get
    assert len(keys) == 28
    assert sent == sorted(sent) and len(sent) == 7, sent


@pytest.mark.parametrize("runs", [1, 2])
def test_suffixes_run_in_shard_order_as_many_at_once_as_asked(gw, runs):
    """Shards decode and run their suffix `suffix_runs` at a time, in shard order: shard i starts
    only once every shard up to i - suffix_runs has ended, so on a compute tier with one core the
    shard read first finishes first instead of all shards in flight finishing together. The
    suffix is slowed so that unordered runs would overlap."""
    client, _, data = gw
    loader = ShardLoader(client, "shards", "train/", MODEL, "stem", batch_size=4, prefetch=4, suffix_runs=runs)
    active, most, lock = [0], [0], threading.Lock()
    runner = loader._runner

    def slowed(split):
        run = runner(split)

        def call(x):
            with lock:
                active[0] += 1
                most[0] = max(most[0], active[0])
            time.sleep(0.1)
            try:
                return run(x)
            finally:
                with lock:
                    active[0] -= 1
        return call

    loader._runner = slowed
    keys = [k for _, _, ks in loader for k in ks]
    assert keys == sorted(data)
    order = [(kind, i) for kind, i, _ in loader.events if kind in ("run_start", "run_end")]
    assert sorted(i for kind, i in order if kind == "run_start") == list(range(7)), order
    assert 1 <= most[0] <= runs
    # Shard i starts only once every shard up to i - runs has ended (in order when runs is 1).
    for at, (kind, i) in enumerate(order):
        if kind == "run_start":
            ended = {j for k, j in order[:at] if k == "run_end"}
            assert set(range(i - runs + 1)) <= ended, (i, order)
    if runs == 1:  # one at a time: each run ends before the next starts
        assert order == [(kind, i) for i in range(7) for kind in ("run_start", "run_end")], order


def test_unchanged_outputs_revalidate_with_304_and_the_loader_keeps_them(gw):
    client, _, _ = gw
    first = client.get("shards", "train/000.tar", MODEL, "block2")
    assert first.etag and first.bytes > 0
    again = client.get("shards", "train/000.tar", MODEL, "block2", if_none_match=first.etag)
    assert again.not_modified and again.bytes == 0 and again.split == "block2"
    other = client.get("shards", "train/000.tar", MODEL, "stem", if_none_match=first.etag)
    assert not other.not_modified and other.bytes > 0  # another split is another output

    rng = np.random.default_rng(9)
    samples = [[(rng.random((3, 32, 32), dtype=np.float32), i % 3) for i in range(4)] for _ in range(3)]
    for s, part in enumerate(samples):
        client.s3.put_object(Bucket="shards", Key=f"kept/{s:03d}.tar", Body=shard(part, 4 * s))
    loader = ShardLoader(client, "shards", "kept/", MODEL, "block2", batch_size=4, local_cache_bytes=1 << 20)
    epoch1 = np.concatenate([f for f, _, _ in loader])
    n = len(loader.fetches)
    assert not any(f.not_modified for f in loader.fetches)
    # Shard 1 is rewritten between epochs: it alone crosses the network again.
    samples[1] = [(x + 1, label) for x, label in samples[1]]
    client.s3.put_object(Bucket="shards", Key="kept/001.tar", Body=shard(samples[1], 4))
    epoch2 = np.concatenate([f for f, _, _ in loader])
    revalidated = [f.not_modified for f in list(loader.fetches)[n:]]
    assert revalidated.count(True) == 2 and len(revalidated) == 3, revalidated
    want = reference(MODEL, "block2", np.stack([x for part in samples for x, _ in part]))
    np.testing.assert_array_equal(epoch2, want)
    assert not np.array_equal(epoch1[4:8], epoch2[4:8])


def test_the_link_probe_reads_the_start_of_the_object(gw):
    client, _, _ = gw
    head, rate = client.probe("shards", "train/000.tar", min_bytes=1024, min_secs=0.0)
    whole = client.get("shards", "train/000.tar").result.features.tobytes()
    assert len(head) >= 1024 and whole.startswith(head) and rate > 0


def post_plan(admin, model, profile, proof, **fields):
    body = {"model": model, "profile": profile, "proof": proof, **fields}
    req = urllib.request.Request(f"{admin}/v1/plan", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def get_plan(admin, model, proof, tenant=None):
    """`GET /v1/plan` with `proof` in its header: the plan, or the refusal's status."""
    q = urllib.parse.urlencode({"model": model, **({"tenant": tenant} if tenant else {})})
    req = urllib.request.Request(f"{admin}/v1/plan?{q}", headers={"x-tensorgate-proof": proof} if proof else {})
    try:
        with urllib.request.urlopen(req) as r:
            return json.load(r)["plan"]
    except urllib.error.HTTPError as e:
        return e.code


def test_planner_picks_the_obvious_split_and_auto_follows_it(gw):
    client, admin, _ = gw
    # Raw objects of 1 MB per sample (large photos): every split moves less than the baseline.
    base = {"batch_size": 8, "samples": 800, "train_secs_per_batch": 0.001, "raw_bytes_per_sample": 1e6,
            "compute_secs_per_sample": {"none": 0.0001, "stem": 0.00005, "block1": 0.00002, "block2": 0.0}}
    # A very slow network: the split with the fewest bytes per sample wins.
    slow = post_plan(admin, MODEL, dict(base, bandwidth_bytes_per_sec=1e4), client.proof())
    sizes = {s["split"]: s["bytes_per_sample"] for s in slow["storage"]["splits"]}
    assert sizes.get(slow["plan"]["chosen"]) == min(sizes.values()), slow  # block1 and block2 tie
    assert {c["split"] for c in slow["plan"]["candidates"]} == {"none", "stem", "block1", "block2"}
    got = client.get("shards", "train/000.tar", MODEL, "auto")
    assert got.split == slow["plan"]["chosen"]
    assert got.plan and all("=" in part for part in got.plan.split(";"))
    # A very fast network and a compute tier far faster than the storage node: no pushdown.
    fast = post_plan(admin, MODEL, dict(base, bandwidth_bytes_per_sec=1e12,
                                        compute_secs_per_sample={"none": 1e-9, "stem": 1e-9, "block1": 1e-9, "block2": 1e-9}),
                     client.proof())
    assert fast["plan"]["chosen"] == "none", fast
    raw = client.get("shards", "train/000.tar", MODEL, "auto")
    assert raw.split == "none" and raw.result.features.tobytes()[257:262] == b"ustar"  # the raw shard, marked


def test_a_plan_needs_a_proof_and_changes_only_the_proven_tenants_split(gw):
    """POST /v1/plan changes `split=auto` for the tenant whose key signed its proof, and for no
    other; without a proof, with a forged one, naming another tenant or with a long-lived proof
    it is refused and nothing changes."""
    client, admin, _ = gw
    profile = {"batch_size": 8, "samples": 800, "train_secs_per_batch": 0.001, "raw_bytes_per_sample": 1e6,
               "bandwidth_bytes_per_sec": 1e4,
               "compute_secs_per_sample": {"none": 0.0001, "stem": 0.00005, "block1": 0.00002, "block2": 0.0}}

    def refused(**fields):
        try:
            post_plan(admin, MODEL, profile, fields.pop("proof", None), **fields)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)["error"]
        return 200, None

    forged = Client(client.endpoint, "tensorgate-dev", "not-the-secret").proof()
    assert refused() == (403, "AccessDenied")
    assert refused(proof=forged) == (403, "AccessDenied")
    assert refused(proof=client.proof(), tenant="someone-else") == (403, "AccessDenied")
    assert refused(proof=client.proof(expires=3600)) == (400, "InvalidArgument")
    assert refused(proof=client.proof()) == (200, None)

    # Reading a plan needs the proof too, and shows only the proven tenant's.
    assert get_plan(admin, MODEL, client.proof()) is not None
    assert get_plan(admin, MODEL, client.proof(), tenant="tensorgate-dev") is not None
    assert get_plan(admin, MODEL, client.proof(), tenant="someone-else") == 403
    assert get_plan(admin, MODEL, None) == 403 and get_plan(admin, MODEL, forged) == 403


def test_model_graphs_and_tokenizers_need_a_proof(gw):
    """The admin port serves a model's graph only to a caller that proves a client key (the
    client sends the proof itself); the model list stays open."""
    client, admin, _ = gw
    url = f"{admin}/v1/models/{MODEL}/suffix?from=stem"
    for headers in ({}, {"x-tensorgate-proof": Client(client.endpoint, "tensorgate-dev", "wrong").proof()}):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(url, headers=headers))
        assert e.value.code == 403 and json.load(e.value)["error"] == "AccessDenied"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"x-tensorgate-proof": client.proof()})) as r:
        assert r.read() == client.suffix_graph(MODEL, "stem")
    with urllib.request.urlopen(f"{admin}/v1/models") as r:
        assert MODEL in {m["name"] for m in json.load(r)["models"]}


def test_f16_features_move_half_the_bytes_and_the_plan_is_sized_for_them(gw):
    """`dtype="f16"`: the loader yields float32 features within f16's rounding of the reference,
    having received about half the bytes; `/v1/storage` and `/v1/plan` size outputs by dtype."""
    client, admin, data = gw
    full = ShardLoader(client, "shards", "train/", MODEL, "block2", batch_size=8)
    half = ShardLoader(client, "shards", "train/", MODEL, "block2", batch_size=8, dtype="f16")
    f32 = np.concatenate([f for f, _, _ in full])
    f16 = np.concatenate([f for f, _, _ in half])
    assert f16.dtype == np.float32 and f16.shape == f32.shape
    want = reference(MODEL, "block2", np.stack([data[k] for k in sorted(data)]))
    np.testing.assert_allclose(f16, want, rtol=2**-10, atol=1e-4)
    assert not np.array_equal(f16, f32), "f16 rounding must show: these were f32 features"
    assert half.bytes_received < 0.6 * full.bytes_received, (half.bytes_received, full.bytes_received)

    def sizes(splits):
        return {s["split"]: s["bytes_per_sample"] for s in splits}

    s32, s16 = sizes(client.storage(MODEL)["splits"]), sizes(client.storage(MODEL, "f16")["splits"])
    assert s16 == {k: v / 2 for k, v in s32.items()}
    profile = {"batch_size": 8, "samples": 800, "train_secs_per_batch": 0.001, "raw_bytes_per_sample": 1e6,
               "bandwidth_bytes_per_sec": 1e4,
               "compute_secs_per_sample": {"none": 0.0001, "stem": 0.00005, "block1": 0.00002, "block2": 0.0}}
    p16 = post_plan(admin, MODEL, profile, client.proof(), dtype="f16")
    p32 = post_plan(admin, MODEL, profile, client.proof())
    c16, c32 = sizes(p16["plan"]["candidates"]), sizes(p32["plan"]["candidates"])
    assert c16 == {k: (v if k == "none" else v / 2) for k, v in c32.items()}
    with pytest.raises(urllib.error.HTTPError) as bad:
        post_plan(admin, MODEL, profile, client.proof(), dtype="f8")
    assert bad.value.code == 400


def test_the_loader_profiles_and_plans_by_itself(gw):
    client, _, data = gw
    loader = ShardLoader(client, "shards", "train/", MODEL, "auto", batch_size=8)
    keys = [k for _, _, ks in loader for k in ks]
    assert keys == sorted(data)
    plan = loader.plans[0]
    assert plan["plan"]["chosen"] in {"none", "stem", "block1", "block2"}
    profiled = set(plan["profile"]["compute_secs_per_sample"])
    assert "none" in profiled
    # One request per shard: the unit the planner pipelines is a shard's samples.
    unit = plan["profile"]["samples_per_request"]
    assert plan["plan"]["samples_per_request"] == unit and plan["profile"]["samples"] == 7 * unit
    # Splits the network alone rules out are not profiled, and the planner says so.
    for c in plan["plan"]["candidates"]:
        assert (c["split"] in profiled) == (c["excluded"] is None), c


@pytest.mark.parametrize("mode", [[], ["--torch", "--workers", "2"], ["--model", "minilm", "--torch", "--workers", "2"],
                                  ["--augment-epochs", "2", "--torch", "--workers", "2"], ["--augment-epochs", "2"]],
                         ids=["numpy", "torch-dataloader", "text-torch-dataloader", "augmented-torch", "augmented-numpy"])
def test_finetune_example_reaches_the_same_accuracy_both_ways(tmp_path, mode):
    """Images (pp-lcnet, WebDataset shards) and texts (minilm, Parquet files of sentences, the
    baseline tokenizing with the gateway's tokenizer): equal accuracies with and without
    pushdown; image features bit-identical, text features equal to float rounding (the gateway
    runs a batch of texts at its longest, the baseline at the model's 128 tokens). Augmented: two
    epochs of crops and flips, drawn alike by the gateway and the baseline, equal again."""
    with run_gateway(tmp_path, "") as (endpoint, admin, _, _):
        r = subprocess.run(
            [sys.executable, str(ROOT / "clients/python/examples/finetune.py"), "--endpoint", endpoint, "--admin", admin,
             "--demo", "192", "--per-shard", "64", *mode],
            capture_output=True, text=True, timeout=600,
        )
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    lines = [l for l in r.stdout.splitlines() if "accuracy" in l]
    accs = [float(l.split("accuracy ")[1].split()[0]) for l in lines]
    assert len(accs) == 2 and accs[0] == accs[1] and accs[0] > 0.5, r.stdout
    err = float(r.stdout.split("features relative L2 difference: ")[1].split(";")[0])
    assert err == 0.0 if "minilm" not in mode else err <= 1e-5, r.stdout
    if "--torch" in mode:
        assert "2 loader workers" in r.stdout


def test_a_text_models_tokenizer_is_served_as_the_gateway_runs_it_and_a_sequence_suffix_is_refused(gw, tmp_path,
                                                                                                   monkeypatch):
    """`Client.tokenizer` is the gateway's tokenizer with its truncation and padding to the model's
    length (a long text comes back as exactly 128 ids); a model without one, or an unknown one, is refused; a
    suffix from `layer2` (it would need the attention mask) is refused before anything runs."""
    from tokenizers import Tokenizer

    from tensorgate.suffix import SuffixRunner

    monkeypatch.setenv("TENSORGATE_CACHE_DIR", str(tmp_path))
    client = gw[0]
    info = client.models()["minilm"]
    assert info["text"] == {"mask": "attention_mask", "length": 128}
    tok = Tokenizer.from_str(client.tokenizer("minilm").decode())
    long, short = tok.encode("word " * 500), tok.encode("a cat")
    assert len(long.ids) == len(short.ids) == 128 and sum(short.attention_mask) == 4
    with pytest.raises(RuntimeError, match="(?s)400.*not a text model"):
        client.tokenizer(MODEL)
    with pytest.raises(RuntimeError, match="(?s)400.*unknown model"):
        client.tokenizer("no-such-model")
    with pytest.raises(ValueError, match="attention mask"):
        SuffixRunner(client, "minilm", "layer2")
    assert SuffixRunner(client, "minilm", "none").tokenizer is not None


def test_the_client_readme_quick_start_runs_as_written(tmp_path):
    """The client README's quick start, verbatim, against the gateway `scripts/run.sh` starts (the
    binary with no flags, from a copy of the repository layout: the embedded default)."""
    import os
    import re
    import socket

    for port in (9000, 9001):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.fail(f"port {port} is in use on this machine: the quick start names it")
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "clients/python/README.md").read_text(), re.S)[:2]
    assert "ShardLoader" in blocks[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
    (tmp_path / "models").symlink_to(ROOT / "models")
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    proc = subprocess.Popen([str(BINARY)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        from conftest import wait_ready

        wait_ready("http://127.0.0.1:9001", proc)
        outs = [subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300)
                for block in blocks]
        for r in outs:
            assert r.returncode == 0, r.stderr
        lines = outs[1].stdout.splitlines()
        assert lines[0].startswith("(3,") and "sample-0" in lines[0], lines  # one batch of the 3 samples
        assert lines[-1] in {"none", "stem", "block1", "block2"}, lines  # the planner's choice
    finally:
        proc.terminate()
        proc.wait(timeout=30)
