"""Data-parallel training the way users run it, against the real binary in front of SeaweedFS:
the client README's DDP example run as written under `torchrun` (2 ranks x 2 spawn workers), and
every dataset class under a gloo process group with spawn and fork workers, then a job resumed from
mid-epoch checkpoints (tests/python/ddp_driver.py). No dataset is given its rank: each rank must
read only its share, whatever start method its workers use."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, free_port, metric, run_gateway
from test_pushdown import tar_of

from tensorgate import Client
from tensorgate.wds import write_index

BUCKET = "datasets"  # the names the README example uses
SIZES = [8, 6, 7, 6]  # 27 samples in uneven shards: an odd total, so padding and dropping show
N = sum(SIZES)
DRIVER = ROOT / "tests" / "python" / "ddp_driver.py"


def png(rng) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def shard(samples: list[tuple[str, bytes, int]]) -> bytes:
    return tar_of([m for key, image, label in samples
                   for m in ((f"{key}.png", image), (f"{key}.cls", str(label).encode()))])


@pytest.fixture(scope="module")
def gw(seaweed, tmp_path_factory):
    """A gateway over a `datasets` bucket: shards `train/NNN.tar` of PNG samples whose label is the
    sample's number (so a label names its sample), their index, and each sample as an object."""
    tmp = tmp_path_factory.mktemp("ddp")
    with run_gateway(tmp, seaweed=seaweed) as (endpoint, admin, s3, _):
        client = Client(endpoint, "tensorgate-dev", "tensorgate-dev-secret", admin=admin)
        rng = np.random.default_rng(31)
        s3.create_bucket(Bucket=BUCKET)
        n = 0
        for s, size in enumerate(SIZES):
            samples = []
            for _ in range(size):
                samples.append((f"s{n:04d}", png(rng), n))
                s3.put_object(Bucket=BUCKET, Key=f"objects/s{n:04d}.png", Body=samples[-1][1])
                n += 1
            s3.put_object(Bucket=BUCKET, Key=f"train/{s:03d}.tar", Body=shard(samples))
        write_index(client, BUCKET, "train/")
        env = dict(os.environ, TG_URL=endpoint, TG_KEY="tensorgate-dev", TG_SECRET="tensorgate-dev-secret",
                   TG_ADMIN=admin, TENSORGATE_CACHE_DIR=str(tmp / "client-cache"), GLOO_SOCKET_IFNAME="lo")
        yield env, admin, tmp


def readme_example() -> str:
    """The DDP example of the client README, verbatim."""
    text = (ROOT / "clients" / "python" / "README.md").read_text()
    start = text.index("```python\n", text.index("DDP (`train.py`")) + len("```python\n")
    return text[start : text.index("```", start)]


# What the README leaves to the reader (its placeholders), and what each rank saw, written out.
PRELUDE = """\
import os
URL, KEY, SECRET, ADMIN = (os.environ[k] for k in ("TG_URL", "TG_KEY", "TG_SECRET", "TG_ADMIN"))
EPOCHS = 2
seen = []
def train_step(features, labels):
    seen.append({"labels": labels.tolist(), "shape": list(features.shape)})
"""
EPILOGUE = """
if __name__ == "__main__":
    import json
    with open(os.path.join(os.environ["OUT"], f"readme-{dist.get_rank()}.json"), "w") as f:
        json.dump({"world": dist.get_world_size(), "seen": seen}, f)
    dist.destroy_process_group()
"""


def test_the_readme_ddp_example_gives_each_rank_its_share_only(gw):
    env, admin, tmp = gw
    script = tmp / "train.py"
    script.write_text(PRELUDE + readme_example() + EPILOGUE)
    plans = metric(admin, "tensorgate_pushdown_plans_total")
    # torchrun as the README starts it; loopback only (static rendezvous on 127.0.0.1).
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
                    "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script)],
                   env=dict(env, OUT=str(tmp)), check=True, timeout=900)
    ranks = [json.loads((tmp / f"readme-{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    each = N // 2  # drop_last=True: 13 samples a rank, one dropped
    labels = [[lab for s in r["seen"] for lab in s["labels"]] for r in ranks]
    assert [len(x) for x in labels] == [2 * each, 2 * each], labels  # its share, not the dataset
    assert len(ranks[0]["seen"]) == len(ranks[1]["seen"])  # as many steps on every rank
    epochs = [[x[e * each : (e + 1) * each] for x in labels] for e in range(2)]
    for per_rank in epochs:
        union = per_rank[0] + per_rank[1]
        assert len(set(union)) == 2 * each and set(union) <= set(range(N))  # disjoint, once each
    assert epochs[0] != epochs[1]  # set_epoch reached the spawned workers: another permutation
    shapes = {tuple(s["shape"][1:]) for r in ranks for s in r["seen"]}
    assert len(shapes) == 1 and len(shapes.pop()) == 3  # features at one split, (C, H, W)
    # split="auto": one process of the job plans (rank 0's worker 0; it may re-plan as loopback's
    # measured rate moves), not one per rank or per worker: one job marker, written by it.
    assert metric(admin, "tensorgate_pushdown_plans_total") - plans >= 1
    assert len(list((tmp / "client-cache").glob("plan-*.json"))) == 1


def test_every_dataset_class_under_ddp_with_spawn_and_fork_workers_and_resume(gw):
    env, _, tmp = gw
    out = tmp / "driver"
    out.mkdir()
    objects = [f"objects/s{n:04d}.png" for n in range(N)]
    subprocess.run([sys.executable, str(DRIVER), str(out)], check=True, timeout=900,
                   env=dict(env, TG_BUCKET=BUCKET, TG_MODEL="tiny-cnn", TG_SPLIT="block2",
                            TG_OBJECTS=json.dumps(objects), MASTER_PORT=str(free_port())))
    runs = [json.loads((out / f"run-{r}.json").read_text()) for r in range(2)]
    every = {f"s{n:04d}" for n in range(N)}
    name_of = lambda k: k.split("/")[-1].split(".")[0].split("#")[0]  # noqa: E731 (objects/s0001.png -> s0001)
    padded = -(-N // 2)  # 14 a rank: the first samples again on the last rank
    for case, each in (("shard-spawn", padded), ("shard-fork", N // 2), ("shard-persistent", padded),
                       ("object-spawn", padded),
                       ("object-fork", padded), ("member-spawn", padded), ("member-fork", padded),
                       ("nodes-shard", padded), ("nodes-object", padded)):
        for epoch in range(2):
            got = [r[case][epoch] for r in runs]
            keys = [[name_of(k) for b in g["batches"] for k in b] for g in got]
            assert [g["len"] for g in got] == [each, each], case  # len() on each rank ...
            assert [len(k) for k in keys] == [each, each], (case, keys)  # ... is what it yields
            assert len(got[0]["batches"]) == len(got[1]["batches"]), case  # equal steps per rank
            assert len(set(keys[0])) == each and len(set(keys[1])) == each, case
            union = set(keys[0]) | set(keys[1])
            if each == padded:  # padding repeats samples; every sample is read
                assert union == every, case
            else:  # dropping: disjoint, one sample left out
                assert not set(keys[0]) & set(keys[1]) and len(union) == N - 1, case
        assert runs[0][case][0]["batches"] != runs[0][case][1]["batches"], case  # epochs differ
    # Resumed in new processes from each rank's mid-epoch checkpoint: exactly the rest of the epoch.
    for r in range(2):
        rest = json.loads((out / f"resume-{r}.json").read_text())["rest"]
        assert runs[r]["head"] + rest == runs[r]["whole"], r
        assert len(runs[r]["head"]) == 2 and rest
    # torchdata.nodes: a Loader's state_dict resumes the dataset mid-epoch too.
    for r in range(2):
        nodes = runs[r]["nodes-resume"]
        epoch1 = runs[r]["nodes-shard"][1]["batches"]
        assert nodes["head"] + nodes["rest"] == epoch1 and len(nodes["head"]) == 2, r
    whole = [[k for b in runs[r]["whole"] for k in b] for r in range(2)]
    assert [len(w) for w in whole] == [padded, padded] and set(whole[0]) | set(whole[1]) == every
