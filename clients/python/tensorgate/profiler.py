"""Profiling the compute tier and the network for the split planner (docs/planner.md).

HAPI profiles online during a first epoch; this profiles on one representative shard before
training: for every candidate split it fetches the shard's features (timing the transfer, so
bandwidth is per request, as HAPI measures it) and times the suffix that finishes the frozen
layers here; for the baseline it fetches the raw shard and times decoding plus every frozen layer.
"""

from __future__ import annotations

import statistics
import time

from .suffix import NO_PUSHDOWN, SuffixRunner


def _timed(fn, *args) -> float:
    fn(*args)  # warm-up (session initialisation, caches)
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def profile(client, bucket: str, key: str, model: str, batch_size: int, *, samples: int | None = None,
            shards: int = 1, train_secs_per_batch: float = 0.0, splits: list[str] | None = None,
            baseline: bool = True, memory_limit: int | None = None) -> dict:
    """A client profile (the planner's `ClientProfile`) measured on shard `key`. `samples` is the
    epoch size (default: the shard's sample count x `shards`); `train_secs_per_batch` is the
    trainable head's time per batch, which only the trainer knows."""
    info = client.models()[model]
    names = [s["name"] for s in info["splits"]]
    candidates = splits or names[: names.index(info["freeze"]) + 1]
    compute, bandwidth, n = {}, [], None
    for split in candidates:
        got = client.get(bucket, key, model, split)
        feats = got.result.features
        n = len(feats)
        if got.transfer_seconds > 0:
            bandwidth.append(got.bytes / got.transfer_seconds)
        runner = SuffixRunner(client, model, split)
        compute[split] = _timed(runner, feats) / n
    raw = client.get(bucket, key)
    if raw.transfer_seconds > 0:
        bandwidth.append(raw.bytes / raw.transfer_seconds)
    if baseline:
        try:
            from .loader import _decode_raw_shard

            runner = SuffixRunner(client, model, NO_PUSHDOWN)
            compute[NO_PUSHDOWN] = _timed(lambda b: runner(_decode_raw_shard(b, info).features),
                                          raw.result.features.tobytes()) / n
        except ImportError:  # no Pillow: the baseline cannot run here, so it is not a candidate
            pass
    return {
        "batch_size": batch_size,
        "samples": samples or n * shards,
        "bandwidth_bytes_per_sec": statistics.median(bandwidth) if bandwidth else 1e9,
        "train_secs_per_batch": train_secs_per_batch,
        "compute_secs_per_sample": compute,
        "raw_bytes_per_sample": raw.bytes / n,
        **({"memory_limit": memory_limit} if memory_limit else {}),
    }


def plan(client, model: str, profile: dict) -> dict:
    """The gateway planner's answer for `profile`: `{"plan": {"chosen", "candidates"}, "storage"}`.
    Later `split=auto` requests for the model use the chosen split."""
    return client.plan(model, profile)
