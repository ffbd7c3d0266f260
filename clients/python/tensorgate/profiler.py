"""Profiling the compute tier and the network for the split planner (docs/planner.md).

HAPI profiles online during a first epoch. This profiles before training, cheaply even on a slow
link:
- the compute side's time per split comes from running each suffix locally on random tensors of the
  split's shape (the gateway reports the shapes with its own terms, `/v1/storage`);
- bandwidth and raw bytes per sample come from fetching one raw shard (the baseline's transfer);
- the baseline's compute comes from decoding that shard and running every frozen layer here.
Nothing is fetched at the (possibly huge) early splits.
"""

from __future__ import annotations

import time

import numpy as np

from .suffix import NO_PUSHDOWN, SuffixRunner

#: Samples per local timing run.
PROBE = 8


def _timed(fn, *args) -> float:
    fn(*args)  # warm-up (session initialisation, caches)
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def profile(client, bucket: str, key: str, model: str, batch_size: int, *, samples: int | None = None,
            shards: int = 1, train_secs_per_batch: float = 0.0, baseline: bool = True,
            memory_limit: int | None = None) -> dict:
    """A client profile (the planner's `ClientProfile`) measured with raw shard `key`. `samples` is
    the epoch size (default: the shard's sample count x `shards`); `train_secs_per_batch` is the
    trainable head's time per batch, which only the trainer knows."""
    storage = client.storage(model)
    rng = np.random.default_rng(0)
    compute = {}
    for split in storage["splits"]:
        x = rng.standard_normal((PROBE, *split["shape"])).astype(np.float32)
        compute[split["split"]] = _timed(SuffixRunner(client, model, split["split"]), x) / PROBE
    raw = client.get(bucket, key)
    body = raw.result.features.tobytes()
    from .loader import _decode_raw_shard

    info = client.models()[model]
    try:
        n = len(_decode_raw_shard(body, info).keys) if not baseline else None
        if baseline:
            runner = SuffixRunner(client, model, NO_PUSHDOWN)
            decoded = []
            secs = _timed(lambda b: decoded.append(runner(_decode_raw_shard(b, info).features)), body)
            n = len(decoded[-1])
            compute[NO_PUSHDOWN] = secs / n
    except ImportError:  # no Pillow: the baseline cannot run here, so it is not a candidate
        n = body.count(b".cls") or 1
    return {
        "batch_size": batch_size,
        "samples": samples or n * shards,
        "bandwidth_bytes_per_sec": raw.bytes / raw.transfer_seconds if raw.transfer_seconds > 0 else 1e10,
        "train_secs_per_batch": train_secs_per_batch,
        "compute_secs_per_sample": compute,
        "raw_bytes_per_sample": raw.bytes / n,
        **({"memory_limit": memory_limit} if memory_limit else {}),
    }


def plan(client, model: str, profile: dict) -> dict:
    """The gateway planner's answer for `profile`: `{"plan": {"chosen", "candidates"}, "storage"}`.
    Later `split=auto` requests for the model use the chosen split."""
    return client.plan(model, profile)
