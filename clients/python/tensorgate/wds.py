"""WebDataset shards on the compute side: grouping a tar's members into samples, decoding a raw
shard as the gateway would (the no-pushdown baseline), reading a `format=tar` pushdown output, and
the sample-count index (`shards.json`, the layout webdataset's `wids` reads) that lets data-parallel
ranks get equal batch counts."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np

from .codec import Features
from .suffix import preprocess

#: What a shard's key ends with: a WebDataset tar, or a Parquet file (`tensorgate.table`).
SHARD_SUFFIXES = (".tar", ".parquet")

#: Member extensions that are a sample's model input (the gateway's policy, docs/pushdown.md).
IMAGE_EXTS = ("jpg", "jpeg", "png")
INPUT_EXTS = (*IMAGE_EXTS, "npy")


def samples(raw: bytes) -> list[tuple[str, dict[str, bytes]]]:
    """The samples of a WebDataset tar in order of first appearance: `(key, {extension: bytes})`,
    where the key is the member path up to the first `.` of its file name and the extension is
    what follows (as spelled)."""
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        for m in tar:
            if not m.isfile():
                continue
            base = m.name.rsplit("/", 1)[-1]
            stem, dot, ext = base.partition(".")
            if not dot:
                continue
            key = m.name[: len(m.name) - len(base)] + stem
            out.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return list(out.items())


def _label(members: dict[str, bytes]) -> int | None:
    cls = next((v for e, v in members.items() if e.lower() == "cls"), None)
    return int(cls.decode().strip()) if cls is not None else None


def _stack(inputs: list[np.ndarray], labels: list[int | None], keys: list[str], **meta) -> Features:
    lab = np.array(labels, dtype=np.int64) if labels and all(l is not None for l in labels) else None
    return Features(features=np.stack(inputs), labels=lab, keys=keys, **meta)


def decode_shard(raw: bytes, info: dict, column: str | None = None, augment=None) -> Features:
    """A raw WebDataset shard decoded here (the baseline): images preprocessed as the gateway
    would (`info` is the model's `/v1/models` entry; with `augment`, each sample's draw by its
    key), `.npy` samples taken as model inputs. A Parquet file's rows are decoded from its `column`
    (`tensorgate.table.decode_table`)."""
    from .table import decode_table, is_parquet

    if is_parquet(raw):
        return decode_table(raw, info, column, augment=augment)
    inputs, labels, keys = [], [], []
    for key, members in samples(raw):
        low = {e.lower(): v for e, v in members.items()}
        img = next((low[e] for e in IMAGE_EXTS if e in low), None)
        if img is not None:
            inputs.append(preprocess(img, info, augment, key))
        elif "npy" in low:  # already the model's input
            inputs.append(np.load(io.BytesIO(low["npy"]), allow_pickle=False).astype(np.float32))
        else:
            continue
        keys.append(key)
        labels.append(_label(members))
    return _stack(inputs, labels, keys)


def decode_features(raw: bytes, split: str | None = None, model: str | None = None) -> Features:
    """A `format=tar` pushdown output: per sample the features as `.npy` beside the shard's other
    members. Returns the stacked features, labels (from `.cls`, when every sample has one), keys,
    and an augmented request's draws (`.augmented` members)."""
    from .augment import Drawn

    feats, labels, keys, drawn = [], [], [], []
    for key, members in samples(raw):
        if "npy" not in members:
            continue
        feats.append(np.load(io.BytesIO(members["npy"]), allow_pickle=False))
        keys.append(key)
        labels.append(_label(members))
        if "augmented" in members:
            drawn.append(Drawn.parse(members["augmented"].decode()))
    if not feats:
        raise ValueError("the tar holds no .npy features")
    out = _stack(feats, labels, keys, split=split, model=model)
    out.augmented = drawn
    return out


def count_samples(raw: bytes) -> int:
    """How many samples a raw shard holds (samples with a model input, as the gateway counts)."""
    return sum(1 for _, m in samples(raw) if any(e.lower() in INPUT_EXTS for e in m))


#: The index object's format tag (webdataset's `wids` reads the same layout).
INDEX_KIND = "wids-shard-index-v1"


def make_index(counts: dict[str, int], name: str = "") -> dict:
    """A shard index: `{"__kind__", "name", "shardlist": [{"url": key, "nsamples": n}, ...]}`."""
    return {"__kind__": INDEX_KIND, "wids_version": 1, "name": name,
            "shardlist": [{"url": k, "nsamples": n} for k, n in counts.items()]}


def write_index(client, bucket: str, prefix: str, name: str = "shards.json") -> dict[str, int]:
    """Counts the samples of every `.tar` under `prefix` (one raw read each: run it beside the
    store, where the shards are written) and the rows of every `.parquet` (from its footer: two
    ranged reads), and stores the index as `prefix + name`. Returns the counts by key."""
    from .table import row_count

    counts = {}
    for key in client.list_keys(bucket, prefix, SHARD_SUFFIXES):
        if key.endswith(".parquet"):
            counts[key] = row_count(client, bucket, key)
        else:
            counts[key] = count_samples(client.s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    client.s3.put_object(Bucket=bucket, Key=prefix + name, Body=json.dumps(make_index(counts, prefix)).encode(),
                         ContentType="application/json")
    return counts


def read_index(client, bucket: str, key: str) -> dict[str, int]:
    """The sample counts of a stored index, by shard key."""
    index = json.loads(client.s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    if index.get("__kind__") != INDEX_KIND:
        raise ValueError(f"{bucket}/{key} is not a shard index ({INDEX_KIND})")
    return {s["url"]: int(s["nsamples"]) for s in index["shardlist"]}
