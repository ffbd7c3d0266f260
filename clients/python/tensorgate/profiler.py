"""Profiling the compute tier and the network for the split planner (docs/planner.md).

HAPI profiles online during a first epoch. This profiles before training, cheaply even on a slow
link:
- the compute side's time per split comes from running each suffix locally on random tensors of the
  split's shape (the gateway reports the shapes with its own terms, `/v1/storage`);
- bandwidth and raw bytes per sample come from fetching the first 512 KiB of one raw shard;
- the baseline's compute comes from decoding the samples in those bytes and running every frozen
  layer here;
- the CPU this process spends per received byte (network stack, HTTP, copies) becomes the
  planner's deserialisation term: on a small compute node it competes with the suffix.
Nothing is fetched at the (possibly huge) early splits.
"""

from __future__ import annotations

import time

import numpy as np

from .suffix import NO_PUSHDOWN, SuffixRunner

#: Samples per local timing run.
PROBE = 8
#: Bytes of a raw shard fetched to measure bandwidth and sample sizes (0.4 s at 10 Mbit/s).
PROBE_BYTES = 512 * 1024


def _timed(fn, *args) -> float:
    fn(*args)  # warm-up (session initialisation, caches)
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def _complete_members(partial: bytes) -> tuple[bytes, list[int]]:
    """The whole members at the start of a partial tar (re-packed as a tar) and the sizes of its
    image members."""
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
                    dst.addfile(m, io.BytesIO(data))
                    if m.name.lower().endswith((".jpg", ".jpeg", ".png", ".npy")):
                        sizes.append(m.size + 1024)  # member headers and padding, with its label
        except (tarfile.TarError, OSError, EOFError):
            pass
    return out.getvalue(), sizes


def profile(client, bucket: str, key: str, model: str, batch_size: int, *, samples: int | None = None,
            shards: int = 1, train_secs_per_batch: float = 0.0, baseline: bool = True,
            memory_limit: int | None = None, probe_bytes: int = PROBE_BYTES) -> dict:
    """A client profile (the planner's `ClientProfile`) measured with raw shard `key`. `samples` is
    the epoch size (default: estimated from the shard's size x `shards`); `train_secs_per_batch` is
    the trainable head's time per batch, which only the trainer knows."""
    storage = client.storage(model)
    # The first `probe_bytes` of the raw shard: bandwidth, sample sizes, baseline inputs.
    cpu = time.process_time()
    raw = client.get(bucket, key, range=f"bytes=0-{probe_bytes - 1}")
    # Receiving and decoding a response costs this process CPU (network stack, HTTP parsing,
    # copies) on the same cores that run the suffix: the planner's per-byte NP term.
    receive_cpu = (time.process_time() - cpu) / max(raw.bytes, 1)
    bandwidth = raw.bytes / raw.transfer_seconds if raw.transfer_seconds > 0 else 1e10
    whole, sizes = _complete_members(raw.result.features.tobytes())
    per_sample = sum(sizes) / len(sizes) if sizes else float(raw.bytes)
    shard_bytes = client.sizes(bucket, key).get(key, raw.bytes)
    compute = {}
    if baseline and sizes:
        from .loader import _decode_raw_shard

        info = client.models()[model]
        try:
            runner = SuffixRunner(client, model, NO_PUSHDOWN)
            n = len(_decode_raw_shard(whole, info).keys)
            compute[NO_PUSHDOWN] = _timed(lambda b: runner(_decode_raw_shard(b, info).features), whole) / n
        except ImportError:  # no Pillow: the baseline cannot run here, so it is not a candidate
            pass
    # A split whose features alone take longer to cross the network than the baseline's whole
    # per-sample cost (its transfer plus its compute) cannot win: it is not profiled (saves an
    # inference session each; at 10 Mbit/s that is every early split).
    ceiling = per_sample / bandwidth + compute[NO_PUSHDOWN] if NO_PUSHDOWN in compute else float("inf")
    rng = np.random.default_rng(0)
    for split in storage["splits"]:
        if split["bytes_per_sample"] / bandwidth > ceiling:
            continue
        x = rng.standard_normal((PROBE, *split["shape"])).astype(np.float32)
        compute[split["split"]] = _timed(SuffixRunner(client, model, split["split"]), x) / PROBE
    return {
        "batch_size": batch_size,
        "samples": samples or max(1, round(shard_bytes / per_sample)) * shards,
        "bandwidth_bytes_per_sec": bandwidth,
        "train_secs_per_batch": train_secs_per_batch,
        "compute_secs_per_sample": compute,
        "raw_bytes_per_sample": per_sample,
        "decode_secs_per_byte": max(receive_cpu, 5e-10),
        **({"memory_limit": memory_limit} if memory_limit else {}),
    }


def plan(client, model: str, profile: dict) -> dict:
    """The gateway planner's answer for `profile`: `{"plan": {"chosen", "candidates"}, "storage"}`.
    Later `split=auto` requests for the model use the chosen split."""
    return client.plan(model, profile)
