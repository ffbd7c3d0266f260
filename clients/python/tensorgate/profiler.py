"""Profiling the compute tier and the network for the split planner (docs/planner.md).

HAPI profiles online during a first epoch. This profiles before training, cheaply even on a slow
link:
- the compute side's time per split comes from running each suffix locally on random tensors of the
  split's shape (the gateway reports the shapes with its own terms, `/v1/storage`). These timings
  depend only on the model version, the split, this machine and the thread count, so they are kept
  on disk (`cache_dir()/profile-*.json`) like the suffix graphs: a later run of the same model here
  skips the sessions and runs;
- bandwidth and raw bytes per sample come from reading the start of one raw shard
  (`Client.probe`: the sustained rate from its first read that waited for the network, read until
  it settles: 0.15-0.6 s, or 4 MiB); for a
  Parquet file, bytes per sample are its size over its rows (its footer);
- the baseline's compute is decoding the samples in those bytes (for Parquet, the first rows of
  its first row group, read by ranges) (measured every time: it depends on the data) plus every
  frozen layer here (timed on random inputs, cached like the suffixes; a text encoder's on those
  texts, whose lengths set its cost);
- the CPU this process spends per received byte (network stack, HTTP, copies) becomes the
  planner's deserialisation term: on a small compute node it competes with the suffix.
Nothing is fetched at the (possibly huge) early splits.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time

import numpy as np
import onnxruntime as ort

from .suffix import NO_PUSHDOWN, SuffixRunner, cache_dir
from .table import first_rows
from .wds import decode_shard

#: Samples per local timing run.
PROBE = 8


def _timed(fn, *args) -> float:
    fn(*args)  # warm-up (session initialisation, caches)
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def _complete_members(partial: bytes, keep: int = 0) -> tuple[bytes, list[int]]:
    """The whole members at the start of a partial tar: the first `keep` samples' members re-packed
    as a tar (all when 0), and the sizes of every image member."""
    import io
    import tarfile

    out, sizes = io.BytesIO(), []
    with tarfile.open(fileobj=out, mode="w") as dst:
        try:
            with tarfile.open(fileobj=io.BytesIO(partial)) as src:
                for m in src:
                    data = src.extractfile(m).read() if m.isfile() else None
                    if data is None or len(data) != m.size:
                        break
                    if not keep or len(sizes) < keep:
                        dst.addfile(m, io.BytesIO(data))
                    if m.name.lower().endswith((".jpg", ".jpeg", ".png", ".npy")):
                        sizes.append(m.size + 1024)  # member headers and padding, with its label
        except (tarfile.TarError, OSError, EOFError):
            pass
    return out.getvalue(), sizes


class _Timings:
    """Seconds per sample of this machine's suffix runs, by model version and split, on disk."""

    def __init__(self, info: dict, threads: int):
        host = f"{platform.machine()}-{os.cpu_count()}-{_cpu_model()}-ort{ort.__version__}-t{threads}"
        digest = hashlib.sha256(host.encode()).hexdigest()[:12]
        self.path = cache_dir() / f"profile-{info['name']}-{info['sha256'][:16]}-{digest}.json"
        try:
            self.known = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.known = {}
        self.dirty = False

    def get(self, split: str, measure) -> float:
        if split not in self.known:
            self.known[split] = measure()
            self.dirty = True
        return self.known[split]

    def save(self) -> None:
        if self.dirty:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(self.known))
            tmp.replace(self.path)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "")
    except OSError:
        return ""


def _suffix_secs(client, model: str, split: str, shape, threads: int) -> float:
    x = np.random.default_rng(0).standard_normal((PROBE, *shape)).astype(np.float32)
    return _timed(SuffixRunner(client, model, split, threads=threads), x) / PROBE


def profile(client, bucket: str, key: str, model: str, batch_size: int, *, samples: int | None = None,
            shards: int = 1, requests: int | None = None, train_secs_per_batch: float = 0.0, baseline: bool = True,
            memory_limit: int | None = None, threads: int = 1, cached: bool = True,
            storage: dict | None = None, dtype: str | None = None, column: str | None = None) -> dict:
    """A client profile (the planner's `ClientProfile`) measured with raw shard `key`. `samples` is
    the epoch size (default: estimated from the shard's size x `shards`); `requests` the GETs an
    epoch is fetched in (default one per shard; a Parquet file's row groups are one each), which
    sizes the unit the tiers pipeline (`samples_per_request`); `train_secs_per_batch` is
    the trainable head's time per batch, which only the trainer knows. `cached=False` re-times
    every suffix instead of using the timings kept on disk; `storage` is a `/v1/storage` answer the
    caller already has; `dtype` the features' element type the caller will ask for; `column` a
    Parquet file's input column (default: the gateway's). A text model's candidates are the
    baseline and its freeze split: a suffix from a sequence split would need the attention mask."""
    storage = storage or client.storage(model, dtype)  # the gateway's terms, if the caller has them
    info = client.models()[model]
    timings = _Timings(info, threads)
    if not cached:
        timings.known = {}
    # The start of the raw shard: bandwidth, sample sizes, baseline inputs.
    cpu = time.process_time()
    head, bandwidth = client.probe(bucket, key)
    # Receiving a response costs this process CPU (network stack, HTTP parsing, copies) on the
    # same cores that run the suffix: the planner's per-byte NP term.
    receive_cpu = (time.process_time() - cpu) / max(len(head), 1)
    text = bool(info.get("text"))
    if key.endswith(".parquet"):
        whole, rows, shard_bytes = first_rows(client, bucket, key, info, column, PROBE)
        per_sample = shard_bytes / max(rows, 1)
        sizes = [per_sample] if rows else []
    else:
        whole, sizes = _complete_members(head, keep=PROBE // 2)
        per_sample = sum(sizes) / len(sizes) if sizes else float(len(head))
        shard_bytes = client.sizes(bucket, key).get(key, len(head))
    compute, tokens = {}, None
    if baseline and sizes:
        try:
            n = len(decode_shard(whole, info, column).keys)  # also the warm-up (imports Pillow)
            t = time.perf_counter()
            inputs = decode_shard(whole, info, column).features
            decode = (time.perf_counter() - t) / n
            if text:  # tokenizing and encoding these texts: their lengths set the cost
                runner = SuffixRunner(client, model, NO_PUSHDOWN, threads=threads)
                frozen = _timed(runner, inputs) / n
                # The storage node's costs too, where it cuts batches to their longest text.
                masks = [e.attention_mask for e in runner.tokenizer.encode_batch([str(t) for t in inputs])]
                tokens = sum(map(sum, masks)) / max(len(masks), 1)
            else:
                frozen = timings.get(
                    NO_PUSHDOWN, lambda: _suffix_secs(client, model, NO_PUSHDOWN, info["input_shape"], threads))
            compute[NO_PUSHDOWN] = decode + frozen
        except ImportError:  # no Pillow: the baseline cannot run here, so it is not a candidate
            pass
    # A split whose features alone take longer to cross the network than the baseline's whole
    # per-sample cost (its transfer plus its compute) cannot win: it is not profiled (saves an
    # inference session each; at 10 Mbit/s that is every early split).
    ceiling = per_sample / bandwidth + compute[NO_PUSHDOWN] if NO_PUSHDOWN in compute else float("inf")
    for split in storage["splits"]:
        if split["bytes_per_sample"] / bandwidth > ceiling:
            continue
        if split["split"] == info["freeze"]:
            compute[split["split"]] = 0.0  # nothing left to run here
            continue
        if text:
            continue  # no suffix from a sequence split (SuffixRunner): not a candidate
        compute[split["split"]] = timings.get(
            split["split"], lambda s=split: _suffix_secs(client, model, s["split"], s["shape"], threads))
    timings.save()
    per_shard = max(1, round(shard_bytes / per_sample))
    samples = samples or per_shard * shards
    return {
        "batch_size": batch_size,
        "samples": samples,
        "samples_per_request": max(1, round(samples / requests)) if requests else per_shard,
        "bandwidth_bytes_per_sec": bandwidth,
        "train_secs_per_batch": train_secs_per_batch,
        "compute_secs_per_sample": compute,
        "raw_bytes_per_sample": per_sample,
        "decode_secs_per_byte": max(receive_cpu, 5e-10),
        **({"memory_limit": memory_limit} if memory_limit else {}),
        **({"tokens_per_sample": tokens} if tokens else {}),
    }


def plan(client, model: str, profile: dict, dtype: str | None = None) -> dict:
    """The gateway planner's answer for `profile` and `dtype` outputs: `{"plan": {"chosen",
    "candidates"}, "storage"}`. Later `split=auto` requests for the model use the chosen split."""
    return client.plan(model, profile, dtype)
