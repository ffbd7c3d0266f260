"""The memory governor through the real gateway binary: outputs do not depend on the batch sizes
chosen, the memory model is reported, and a 64-client burst under a small budget completes within
it (process RSS measured from /proc)."""

import concurrent.futures
import io
import json
import tarfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import urllib3
from botocore.config import Config

from conftest import metric, run_gateway
from test_pushdown import MODELS, npy_bytes

NO_CACHE = "[pushdown.cache]\nenabled = false\n"


def npy_shard(samples: list[np.ndarray]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i, x in enumerate(samples):
            data = npy_bytes(x)
            info = tarfile.TarInfo(f"s{i:03d}.npy")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def features(raw: bytes) -> np.ndarray:
    """The `features` tensor (f32) of a safetensors response."""
    n = int.from_bytes(raw[:8], "little")
    info = json.loads(raw[8 : 8 + n])["features"]
    return np.frombuffer(raw[8 + n :][slice(*info["data_offsets"])], dtype=np.float32).reshape(info["shape"])


def presigned(s3, bucket, key):
    return s3.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key}, ExpiresIn=600)


def sigv4(s3):
    """The same client, presigning with SigV4 (boto3 presigns S3 with SigV2 by default)."""
    import boto3

    return boto3.session.Session().client(
        "s3", endpoint_url=s3.meta.endpoint_url, aws_access_key_id="tensorgate-dev",
        aws_secret_access_key="tensorgate-dev-secret", region_name="us-east-1",
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )


def features_of(http, url, model, split, batch=None):
    headers = {"x-tensorgate-model": model, "x-tensorgate-split": split}
    if batch:
        headers["x-tensorgate-batch"] = str(batch)
    r = http.request("GET", url, headers=headers)
    assert r.status == 200, r.data[:400]
    return features(r.data)


SPLITS = {"tiny-cnn": "block2", "tiny-vit": "block1", "resnet18": "layer2"}


def test_outputs_are_identical_whatever_the_batch_sizes(tmp_path):
    """Batch 1 (max_batch = 1), the requested batch of 12 without adaptation, and adaptation under a
    budget that forces small storage batches: the same bytes for every model."""
    rng = np.random.default_rng(5)
    inputs = {m: [rng.random(MODELS[m][1], dtype=np.float32) for _ in range(12)] for m in SPLITS}
    configs = {
        "batch-1": "[pushdown]\nmax_batch = 1\nworkers = 1\n" + NO_CACHE,
        "requested-12": "[pushdown]\nadaptation = false\nworkers = 1\nqueue_capacity = 64\n" + NO_CACHE,
        "adaptive": "[pushdown]\nworkers = 2\n" + NO_CACHE,
    }
    http = urllib3.PoolManager()
    results, batches = {}, {}
    for name, cfg in configs.items():
        with run_gateway(tmp_path, cfg) as (_, admin, s3, _):
            signer = sigv4(s3)
            for model, split in SPLITS.items():
                s3.put_object(Bucket="demo", Key=f"{model}.tar", Body=npy_shard(inputs[model]))
                url = presigned(signer, "demo", f"{model}.tar")
                batch = {"requested-12": 12, "adaptive": 3}.get(name)
                results[(name, model)] = features_of(http, url, model, split, batch)
            batches[name] = metric(admin, "tensorgate_pushdown_batch_size_sum") / max(
                metric(admin, "tensorgate_pushdown_batch_size_count"), 1)
    assert batches["batch-1"] == 1.0 and batches["requested-12"] > 1.0, batches
    for model in SPLITS:
        base = results[("batch-1", model)]
        for name in ("requested-12", "adaptive"):
            assert results[(name, model)].tobytes() == base.tobytes(), (model, name)


def test_memory_model_is_reported(tmp_path):
    with run_gateway(tmp_path, NO_CACHE) as (_, admin, s3, _):
        x = np.random.default_rng(1).random((3, 224, 224), dtype=np.float32)
        s3.put_object(Bucket="demo", Key="r.npy", Body=npy_bytes(x))
        http = urllib3.PoolManager()
        r = http.request("GET", presigned(sigv4(s3), "demo", "r.npy"),
                         headers={"x-tensorgate-model": "resnet18", "x-tensorgate-split": "layer1"})
        assert r.status == 200
        with urllib.request.urlopen(f"{admin}/v1/memory") as resp:
            report = json.load(resp)
    assert report["adaptation"] is True and report["budget_bytes"] == 1 << 30
    engine = next(e for e in report["engines"] if e["model"] == "resnet18" and e["split"] == "layer1")
    m = engine["memory"]
    assert m["measured"] is True
    assert m["input_bytes_per_sample"] == 3 * 224 * 224 * 4
    assert m["output_bytes_per_sample"] == 64 * 56 * 56 * 4
    # The stem's activations (64 x 112 x 112 floats) alone exceed the split's output.
    assert m["activation_bytes_per_sample"] >= 64 * 112 * 112 * 4
    assert m["fixed_bytes"] >= m["session_bytes"] > 0
    assert (m["queued_bytes_per_sample"], m["held_bytes_per_sample"]) == (2 * 3 * 224 * 224 * 4, 3 * 64 * 56 * 56 * 4)
    # The 1 GiB default holds both workers at the default batch cap of 16.
    assert engine["batch_cap"] == 16
    # The engine keeps its prefix's ONNX bytes to build sessions: at least conv1's and layer1's
    # weights (64x3x7x7 + 4 x 64x64x3x3 floats), reserved once per engine.
    assert m["prefix_bytes"] >= 4 * (64 * 3 * 7 * 7 + 4 * 64 * 64 * 3 * 3)
    assert engine["reserved_bytes"] == (engine["workers"] * (m["fixed_bytes"] + 16 * m["activation_bytes_per_sample"])
                                        + m["prefix_bytes"])
    assert report["reserved_bytes"] >= engine["reserved_bytes"]


def rss(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


BURST_BUDGET = 384 << 20
# A wait bound no run reaches (10 minutes): every client must be served, however slow the machine.
BURST_CONFIG = f"[pushdown]\nmemory_budget = {BURST_BUDGET}\nmax_wait_ms = 600000\n" + NO_CACHE
BURST_HEADERS = {"x-tensorgate-model": "resnet18", "x-tensorgate-split": "layer1", "x-tensorgate-batch": "64"}


def burst_urls(s3, prefix: str, samples: int, seed: int) -> list[str]:
    """64 copies of a shard of `samples` random ResNet inputs (600 kB each), presigned."""
    rng = np.random.default_rng(seed)
    shard = npy_shard([rng.random((3, 224, 224), dtype=np.float32) for _ in range(samples)])
    for i in range(64):
        s3.put_object(Bucket="demo", Key=f"{prefix}/{i}.tar", Body=shard)
    signer = sigv4(s3)
    return [presigned(signer, "demo", f"{prefix}/{i}.tar") for i in range(64)]


def test_a_64_client_burst_stays_within_the_budget(tmp_path):
    with run_gateway(tmp_path, BURST_CONFIG) as (_, admin, s3, pid):
        urls = burst_urls(s3, "burst", samples=4, seed=2)
        http = urllib3.PoolManager(maxsize=64)
        headers = BURST_HEADERS
        assert http.request("GET", urls[0], headers=headers).status == 200  # engine started and measured
        baseline = rss(pid, "VmRSS:")
        Path(f"/proc/{pid}/clear_refs").write_text("5")
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            responses = list(pool.map(lambda u: http.request("GET", u, headers=headers, retries=False), urls))
        peak = rss(pid, "VmHWM:")
        statuses = [r.status for r in responses]
        assert all(s == 200 or (s == 503 and r.headers.get("retry-after")) for s, r in zip(statuses, responses)), statuses
        assert statuses.count(200) == 64, statuses  # nobody had to give up
        with urllib.request.urlopen(f"{admin}/v1/memory") as resp:
            report = json.load(resp)
        engine = report["engines"][0]
        sessions = engine["workers"] * engine["memory"]["session_bytes"]
        grown = peak - baseline
        print(f"baseline {baseline >> 20} MiB, peak {peak >> 20} MiB, budget {BURST_BUDGET >> 20} MiB, "
              f"sessions {sessions >> 20} MiB")
        # The sessions are resident in the baseline and reserved in the budget; the burst may add
        # the rest of the budget plus the documented overhead (docs/pushdown.md: 64 MiB).
        assert grown <= BURST_BUDGET - sessions + (64 << 20), f"grew {grown >> 20} MiB"
        assert report["reserved_bytes"] == engine["reserved_bytes"], "requests left reservations behind"
        assert metric(admin, "tensorgate_pushdown_admission_deferrals_total") > 0, "the budget never bit"


def test_a_cold_burst_whose_sources_fill_the_budget_gives_way_and_every_client_is_served(tmp_path):
    """64 clients at once on a cold engine, each asking for a shard whose outputs (8 x 2.4 MB) are
    four times its source (4.8 MB): 64 sources alone take more than the budget leaves beside the
    engine, in either arena mode, and nothing had opened yet to say how much a request needs. The
    youngest requests holding a source give it back with 503 SlowDown (Retry-After) so the oldest
    go on; clients that retry as the header says are all served, and nobody waits for a deadlock
    to time out (each attempt is bounded far below the edge's request timeout)."""
    with run_gateway(tmp_path, BURST_CONFIG) as (_, admin, s3, _):
        urls = burst_urls(s3, "cold", samples=8, seed=3)
        http = urllib3.PoolManager(maxsize=64)

        def fetch(url):
            answers = []
            for _ in range(30):
                r = http.request("GET", url, headers=BURST_HEADERS, retries=False, timeout=urllib3.Timeout(read=120))
                answers.append(r.status)
                if r.status != 503:
                    return r, answers
                assert r.headers.get("retry-after") == "1", r.data[:300]
                time.sleep(int(r.headers["retry-after"]))
            return r, answers

        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            results = list(pool.map(fetch, urls))
        statuses = [s for _, answers in results for s in answers]
        assert all(r.status == 200 for r, _ in results), statuses
        assert features(results[0][0].data).shape == (8, 64, 56, 56)
        gave_way = metric(admin, "tensorgate_pushdown_admission_yields_total")
        print(f"{statuses.count(503)} answers 503, {gave_way} requests gave way")
        assert gave_way > 0, "the sources never filled the budget"
        # Each request that gave way answered its client 503 once; none waited past max_wait.
        assert statuses.count(503) >= gave_way
        assert metric(admin, "tensorgate_pushdown_admission_timeouts_total") == 0
        with urllib.request.urlopen(f"{admin}/v1/memory") as resp:
            report = json.load(resp)
        assert report["reserved_bytes"] == report["engines"][0]["reserved_bytes"], "requests left reservations behind"


def held_after_every_batch_size(tmp_path, arena: str, seed: int, back: bool):
    """Runs ResNet-50-thin `stage1` (the model whose arena grew most: ADR 0011) through an engine
    of one worker at every batch size 1-12 in a seeded random order (`back`: then in reverse),
    and returns what the process holds above its pre-engine size afterwards, and the engine's
    `/v1/memory` entry."""
    cfg = f"[pushdown]\nort_arena = \"{arena}\"\nworkers = 1\nmax_batch = 12\n" + NO_CACHE
    with run_gateway(tmp_path, cfg) as (_, admin, s3, pid):
        rng = np.random.default_rng(seed)
        sizes = [int(n) for n in rng.permutation(np.arange(1, 13))]
        for n in sizes:
            shard = npy_shard([rng.random((224, 224, 3), dtype=np.float32) for _ in range(n)])
            s3.put_object(Bucket="demo", Key=f"sizes/{n}.tar", Body=shard)
        signer = sigv4(s3)
        http = urllib3.PoolManager()
        headers = {"x-tensorgate-model": "resnet50-thin", "x-tensorgate-split": "stage1"}
        baseline = rss(pid, "VmRSS:")  # the process before the engine exists
        for n in sizes + (sizes[::-1] if back else []):
            r = http.request("GET", presigned(signer, "demo", f"sizes/{n}.tar"), headers=headers)
            assert r.status == 200, r.data[:400]
            assert features(r.data).shape[0] == n
        held = rss(pid, "VmRSS:") - baseline
        with urllib.request.urlopen(f"{admin}/v1/memory") as resp:
            report = json.load(resp)
    # The batch and input buffers kept between batches (at most `scratch_bound_bytes`, outside
    # the budget: ADR 0023) are not the engine's.
    assert report["scratch_kept_bytes"] <= report["scratch_bound_bytes"]
    return held - report["scratch_kept_bytes"], report["engines"][0]


def test_an_engine_that_keeps_its_arena_stays_within_its_reservation(tmp_path):
    """With `pushdown.ort_arena = "kept"`, sessions keep their run buffers: the engine's memory
    model is measured on what stays (a sweep over every batch size), and after runs at batch sizes
    in any order the process holds no more than the engine reserved."""
    held, engine = held_after_every_batch_size(tmp_path, "kept", seed=3, back=True)
    m = engine["memory"]
    assert (m["method"], m["measured"], engine["batch_cap"]) == ("retention", True, 12)
    assert engine["reserved_bytes"] == m["fixed_bytes"] + 12 * m["activation_bytes_per_sample"] + m["prefix_bytes"]
    print(f"held {held >> 20} MiB after all batch sizes, engine reserved {engine['reserved_bytes'] >> 20} MiB")
    # What the process holds beyond its pre-engine size, with every request answered, is the
    # engine (session and arena) plus allocator slack: 16 MiB. (Measured with memory patterns on
    # and the peak probes: 119 MiB held against 59 MiB reserved.)
    assert held <= engine["reserved_bytes"] + (16 << 20), f"held {held >> 20} MiB"


def test_an_engine_that_gives_its_arena_back_holds_only_its_session(tmp_path):
    """With `pushdown.ort_arena = "per-run"` runs allocate from ONNX Runtime's CPU arena and give it
    back at their end (ADR 0012): after batches of every size, the process holds the engine's
    session and no run buffers, and the engine's model is the peak-probe one. An arena that is
    kept, or whose last region still holds a run's output when the run ends (the output is written
    into a buffer of the gateway's to avoid that), stays resident: 53-56 MiB here, against 22 MiB."""
    held, engine = held_after_every_batch_size(tmp_path, "per-run", seed=4, back=False)
    m = engine["memory"]
    assert (m["method"], m["measured"], engine["batch_cap"]) == ("peaks", True, 12)
    run12 = m["fixed_bytes"] + 12 * m["activation_bytes_per_sample"] - m["session_bytes"]
    print(f"held {held >> 20} MiB after all batch sizes; session {m['session_bytes'] >> 20} MiB, "
          f"a batch-12 run {run12 >> 20} MiB")
    # The session plus allocator slack, well under one batch-12 run (about 60 MiB, so a retained
    # run still fails this). The slack was 11-13 MiB on a quiet machine and 20 MiB once in a CI run
    # on a loaded one (more blocking threads, each with a malloc arena of its own): 24 MiB.
    assert held <= m["session_bytes"] + (24 << 20), f"held {held >> 20} MiB"
    assert run12 > (32 << 20), "the check above must be able to tell a retained run from none"


def test_the_allocator_settings_an_environment_brings(tmp_path):
    """The gateway restarts itself with glibc's 128 KiB mmap threshold and huge pages advised for
    large mappings (ADR 0012) unless the environment sets a threshold of its own, which it then
    keeps as given; other tunables are kept beside its own. Whatever the settings, pushdown answers
    with the same bytes, and the memory model is measured either way: a 32 MiB threshold (heaps
    keep what runs freed) once made engines not fit and answered 500."""
    rng = np.random.default_rng(6)
    shard = npy_shard([rng.random((3, 224, 224), dtype=np.float32) for _ in range(3)])
    settings = [None, "glibc.malloc.mmap_threshold=33554432", "glibc.malloc.arena_max=1",
                "glibc.malloc.mmap_threshold=131072"]
    http, outputs, methods = urllib3.PoolManager(), {}, {}
    for given in settings:
        env = {"GLIBC_TUNABLES": given} if given else {}
        cfg = f"[pushdown]\nmemory_budget = {2 << 30}\n" + NO_CACHE
        with run_gateway(tmp_path, cfg, env=env) as (_, admin, s3, _):
            s3.put_object(Bucket="demo", Key="alloc.tar", Body=shard)
            url = presigned(sigv4(s3), "demo", "alloc.tar")
            outputs[given] = features_of(http, url, "resnet18", "layer2")
            with urllib.request.urlopen(f"{admin}/v1/memory") as resp:
                methods[given] = json.load(resp)["engines"][0]["memory"]["method"]
    first = outputs[None]
    assert first.shape[0] == 3
    for given, out in outputs.items():
        assert out.tobytes() == first.tobytes(), given
    assert set(methods.values()) == {"peaks"}, methods


def test_an_engine_that_does_not_fit_beside_idle_engines_takes_their_place(tmp_path):
    """A (model, split) whose engine would fit an empty budget, but not beside the engines already
    started, stops the ones no request holds and starts in their place (before: `503 SlowDown`
    until they idled out, minutes later). Engines a request holds are never stopped; a request
    that does not fit beside those is `503 SlowDown` (the governor's unit tests, which also cover
    what can never fit: `400 EntityTooLarge`)."""
    x = np.random.default_rng(4).random((3, 224, 224), dtype=np.float32)
    objects = {"c.npy": npy_bytes(x), "c-nhwc.npy": npy_bytes(x.transpose(1, 2, 0).copy())}
    wanted = [("c.npy", "resnet18", "pool"), ("c-nhwc.npy", "resnet50-thin", "pool")]
    evicted = 'tensorgate_pushdown_engine_evictions_total{reason="memory"}'

    def gateway(budget):
        d = tmp_path / str(budget)
        d.mkdir()
        return run_gateway(d, f"[pushdown]\nmemory_budget = {budget}\n" + NO_CACHE)

    def client(admin, s3):
        """`get(i)`: the i-th wanted pushdown; `engines()`: the started engines' entries."""
        for k, body in objects.items():
            s3.put_object(Bucket="demo", Key=k, Body=body)
        signer, http = sigv4(s3), urllib3.PoolManager()

        def get(i):
            key, model, split = wanted[i]
            return http.request("GET", presigned(signer, "demo", key),
                                headers={"x-tensorgate-model": model, "x-tensorgate-split": split})

        def engines():
            with urllib.request.urlopen(f"{admin}/v1/memory") as resp:
                return [e for e in json.load(resp)["engines"] if e["memory"]]
        return get, engines

    # What each engine needs at batches of one (its workers, one sample), measured side by side.
    with gateway(4 << 30) as (_, admin, s3, _):
        get, engines = client(admin, s3)
        assert get(0).status == 200 and get(1).status == 200
        need = []
        for e in engines():
            m = e["memory"]
            per_sample = m["queued_bytes_per_sample"] + m["held_bytes_per_sample"]
            need.append(e["workers"] * (m["fixed_bytes"] + m["activation_bytes_per_sample"]) + m["prefix_bytes"]
                        + per_sample)
    small, large = sorted(need)
    # Either fits alone, with room for larger batches; never both.
    with gateway(large + small // 2) as (_, admin, s3, _):
        get, engines = client(admin, s3)
        r = get(0)
        assert r.status == 200, r.data[:400]
        assert [(e["model"], e["split"]) for e in engines()] == [("resnet18", "pool")]
        r = get(1)
        assert r.status == 200, r.data[:400]
        assert [(e["model"], e["split"]) for e in engines()] == [("resnet50-thin", "pool")]
        assert metric(admin, evicted) == 1
        # And back: the first one is started again in the second's place.
        assert get(0).status == 200
        assert [(e["model"], e["split"]) for e in engines()] == [("resnet18", "pool")]
        assert metric(admin, evicted) == 2
