"""Streaming pushed-down features into training: one request per WebDataset shard, several in
flight, in order, the next ones fetched while the current batch trains (the cross-tier overlap),
split across data-parallel ranks and loader workers, and batches of exactly `batch_size`."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import secrets
import sys
import threading
import time
from collections import deque

import numpy as np

from .client import Fetch
from .codec import Features
from .profiler import profile as measure
from .ranks import distributed
from .suffix import NO_PUSHDOWN, SuffixRunner
from .table import RangedObject, decode_table, one_row_group, split_unit
from .wds import SHARD_SUFFIXES, decode_shard

#: Default bound of `ShardLoader.events` and `ShardLoader.fetches` (the newest are kept).
HISTORY = 4096


class ShardLoader:
    """Iterates over training batches `(features, labels, keys)` of a bucket prefix of WebDataset
    shards, with features at the model's freeze split whatever split the gateway ran.

    - `split`: a split name, `"none"` (no pushdown: raw shards, decoded and run here) or `"auto"`
      (profile, then ask the gateway's planner; re-plan when the measured bandwidth moves by more
      than `replan_threshold`, or every `replan_every` shards). While it profiles, shard 0 is
      already requested at the split with the fewest bytes, so the storage node does not wait.
    - `rank`/`world_size`: data-parallel sharding (default: from `torch.distributed` when it is
      initialised where the loader is built, else 0 of 1); inside a PyTorch DataLoader worker,
      shards are further split across workers.
    - `prefetch`: shards requested ahead of the one being consumed (in parallel, order kept).
    - `storage_batch`: asked of the gateway (`x-tensorgate-batch`); it may lower it.
    - `suffix_runs`: how many shards may decode and run their suffix at once (default 0: the
      cores this process may use, divided by `suffix_threads`). They go in shard order: shard i
      starts only once every shard up to i - `suffix_runs` has finished, so on a compute tier
      with fewer cores than shards in flight the shard read first finishes first, instead of all
      of them finishing together when they share the cores.
    - `overlap=False` fetches each shard only when the previous one has been consumed (the
      ablation: no cross-tier overlap).
    - `local_cache_bytes`: keep up to this many bytes of finished features (after the suffix) here,
      first come first kept, and revalidate them each epoch with `If-None-Match`: an unchanged
      shard costs one round trip and no transfer or compute (the gateway answers `304` from its
      own cache). 0 (the default) keeps nothing.
    - `keys`: the shard keys to read (in this order) instead of listing `prefix`.
    - `plan=False` with `split="auto"`: do not profile or post a plan; send `split=auto` and let
      the gateway apply the plan someone else posted for this tenant (one plan per job), running
      the suffix of whatever split the response names.
    - `history`: how many `events` and `fetches` are kept (the newest; for measurements).
    - `dtype`: the features' element type on the wire (`"f16"`, `"bf16"`; default f32): half the
      bytes, and the plan of `split="auto"` is sized for it. Batches are yielded as float32.
    - `column`: the image column of Parquet shards (default `image`). Shards listed under
      `prefix` are the keys ending in `.tar` or `.parquet`.
    - `augment`: random crops and flips (`tensorgate.augment.Augment`, ADR 0032), drawn per sample
      from its seed by the gateway, or here where no pushdown ran; set it per epoch
      (`Augment.for_epoch`). Nothing is kept in the local cache while it is set.

    Nothing touches the network before iteration starts.
    """

    def __init__(self, client, bucket: str, prefix: str, model: str, split: str, batch_size: int, *,
                 rank: int | None = None, world_size: int | None = None, prefetch: int = 4, storage_batch: int | None = None,
                 drop_last: bool = False, train_secs_per_batch: float = 0.0, replan_threshold: float = 0.3,
                 replan_every: int = 50, suffix_threads: int = 1, overlap: bool = True,
                 local_cache_bytes: int = 0, keys: list[str] | None = None, plan: bool = True,
                 history: int = HISTORY, dtype: str | None = None, column: str | None = None,
                 suffix_runs: int = 0, augment=None):
        #: The ranks and suffix runs given (`ShardDataset.from_loader` passes these on, so its dataset, in its own
        #: processes, resolves the rest itself).
        self._given = (rank, world_size, suffix_runs)
        seen = distributed() or (0, 1)
        rank = seen[0] if rank is None else rank
        world_size = seen[1] if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ValueError("rank must be in [0, world_size)")
        self.client, self.bucket, self.prefix, self.model = client, bucket, prefix, model
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.prefetch, self.storage_batch, self.drop_last = max(1, prefetch), storage_batch, drop_last
        self.requested_split = split
        self.train_secs_per_batch = train_secs_per_batch
        self.replan_threshold, self.replan_every = replan_threshold, replan_every
        self.suffix_threads = suffix_threads
        self.suffix_runs = suffix_runs or max(1, _cores() // max(1, suffix_threads))
        self.overlap = overlap
        self.local_cache_bytes = local_cache_bytes
        self._held: dict[tuple[str, str], tuple[str, Features]] = {}  # (key, split) -> (ETag, features)
        self._held_bytes = 0
        self.keys, self.planning, self.dtype, self.column = keys, plan, dtype, column
        #: The pass's random augmentation (`tensorgate.augment.Augment`, its epoch's seed): the
        #: gateway draws it, or this side does where no pushdown ran, alike.
        self.augment = augment
        self._info: dict | None = None
        #: ("fetch_start"|"headers"|"run_start"|"run_end"|"fetch_end"|"yield", shard, time), the
        #: newest `history`; a run is the shard's decoding and suffix on this side.
        self.events: deque[tuple[str, int, float]] = deque(maxlen=history)
        #: Per shard, the client's Fetch (bytes, transfer time, split; `result` dropped), the newest
        #: `history`.
        self.fetches: deque = deque(maxlen=history)
        #: Body bytes received and the splits that ran, over this loader's life (unbounded history
        #: is not needed for these).
        self.bytes_received = 0
        self.splits_used: set[str] = set()
        self.plans: list[dict] = []
        #: Seconds the first epoch spent profiling and planning (`split="auto"`).
        self.profile_seconds = 0.0
        self._runners: dict[str, SuffixRunner] = {}
        self._lock = threading.Lock()
        self._turns, self._sends, self._runs = _Turns(), _Turns(), _Turns(self.suffix_runs)
        self._stream = secrets.token_hex(8)  # each pass names its own (`iter_shards`)
        self.split = split

    @property
    def info(self) -> dict:
        """The model's `/v1/models` entry (fetched once, when first needed)."""
        if self._info is None:
            self._info = self.client.models()[self.model]
        return self._info

    # --- which shards --------------------------------------------------------------------------

    def shards(self) -> list[str]:
        keys = self.keys if self.keys is not None else self.client.list_keys(self.bucket, self.prefix, SHARD_SUFFIXES)
        mine = keys[self.rank :: self.world_size]
        if "torch" in sys.modules:  # a DataLoader worker has imported it
            w = sys.modules["torch"].utils.data.get_worker_info()
            if w is not None:
                mine = mine[w.id :: w.num_workers]
        return mine

    # --- fetching ------------------------------------------------------------------------------

    def _runner(self, split: str) -> SuffixRunner:
        with self._lock:
            if split not in self._runners:
                self._runners[split] = SuffixRunner(self.client, self.model, split, threads=self.suffix_threads)
            return self._runners[split]

    def _fetch(self, index: int, key: str, split: str) -> Features:
        self.events.append(("fetch_start", index, time.perf_counter()))
        held = self._held.get((key, split))
        etag = held[0] if held else None
        turns, sends, runs = self._turns, self._sends, self._runs

        def wait():  # the response's headers are here: its body is read in turn
            self.events.append(("headers", index, time.perf_counter()))
            turns.wait(index)

        sent = lambda: sends.done(index)  # noqa: E731
        # A row group of a Parquet file as a shard of its own (`table.ROW_GROUP_MARK`).
        name, group = split_unit(key)
        cut = None  # a row group read here by ranges: (its bytes as a file, its first row)
        try:
            # The requests go out in shard order, so that the gateway, which computes a tenant's
            # requests in the order they arrive, finishes them in the order they are read.
            sends.wait(index)
            if split == NO_PUSHDOWN and group is not None:
                t0 = time.perf_counter()
                wait()
                cut = one_row_group(RangedObject(self.client, self.bucket, name), group)
                t1 = time.perf_counter()
                got = Fetch(Features(features=None), len(cut[0]), t1 - t0, t1 - t0, NO_PUSHDOWN, None, None, t0, t1)
            elif split == NO_PUSHDOWN:
                got = self.client.get(self.bucket, key, if_none_match=etag, before_body=wait, before_send=sent)
            else:
                got = self.client.get(self.bucket, name, self.model, split, batch=self.storage_batch,
                                      dtype=self.dtype, if_none_match=etag, before_body=wait, before_send=sent,
                                      column=self.column, row_groups=None if group is None else str(group),
                                      seq=f"{self._stream}.{index}", augment=self.augment)
        except BaseException:
            runs.done(index)  # later shards do not wait for a run that will not come
            raise
        finally:
            sends.done(index)
            turns.done(index)
        ran = got.split or split  # split=auto: the gateway names what ran ("none": the raw shard)
        # The compute tier's CPU work (decoding, the suffix), in shard order, `suffix_runs` at a time.
        runs.wait(index)
        self.events.append(("run_start", index, time.perf_counter()))
        try:
            if got.not_modified:
                feats = held[1]
            elif ran == NO_PUSHDOWN:
                if group is None:
                    feats = decode_shard(got.result.features.tobytes(), self.info, self.column, self.augment)
                else:
                    # split=auto planned no pushdown: the gateway sent the whole file.
                    cut = cut or one_row_group(got.result.features.tobytes(), group)
                    feats = decode_table(cut[0], self.info, self.column, cut[1], augment=self.augment)
                feats.features = self._runner(NO_PUSHDOWN)(feats.features)
            else:
                feats = got.result
                # f16/bf16 on the wire; float32 to the trainer whether or not a suffix ran.
                feats.features = np.asarray(self._runner(ran)(feats.features), dtype=np.float32)
        finally:
            self.events.append(("run_end", index, time.perf_counter()))
            runs.done(index)
        # An augmented pass's features are its epoch's alone: nothing to keep for the next.
        if self.local_cache_bytes and got.etag and not got.not_modified and self.augment is None:
            self._keep((key, split), got.etag, feats)
        with self._lock:  # the record without its body: the history must not hold features
            self.fetches.append(dataclasses.replace(got, result=None))
            self.bytes_received += got.bytes
            self.splits_used.add(got.split or NO_PUSHDOWN)
        self.events.append(("fetch_end", index, time.perf_counter()))
        return Features(feats.features, feats.labels, list(feats.keys), feats.split, feats.model)

    def _keep(self, at: tuple[str, str], etag: str, feats: Features) -> None:
        def size(f: Features) -> int:
            return f.features.nbytes + (f.labels.nbytes if f.labels is not None else 0)

        with self._lock:
            old = self._held.pop(at, None)
            if old:
                self._held_bytes -= size(old[1])
            if self._held_bytes + size(feats) <= self.local_cache_bytes:
                self._held[at] = (etag, feats)
                self._held_bytes += size(feats)

    def _maybe_replan(self, done: int) -> None:
        if self.requested_split != "auto" or not self.plans:
            return
        bw = link_rate(list(self.fetches)[-4:])
        if bw is None:
            return
        planned = self.plans[-1]["profile"]["bandwidth_bytes_per_sec"]
        moved = abs(bw - planned) / planned > self.replan_threshold
        if moved or (done and done % self.replan_every == 0):
            profile = dict(self.plans[-1]["profile"], bandwidth_bytes_per_sec=bw)
            self._adopt(profile)

    def _adopt(self, profile: dict) -> None:
        answer = self.client.plan(self.model, profile, self.dtype)
        self.plans.append({"profile": profile, **answer})
        self.split = answer["plan"]["chosen"]

    def _start(self, shards: list[str], storage: dict | None = None) -> None:
        if self.requested_split == "auto" and self.planning and not self.plans:
            t = time.perf_counter()

            # Row groups as shards: the profile reads their file, and counts the files.
            files = list(dict.fromkeys(split_unit(k)[0] for k in shards))
            prof = measure(self.client, self.bucket, files[0], self.model, self.batch_size,
                           shards=len(files), requests=len(shards),
                           train_secs_per_batch=self.train_secs_per_batch, threads=self.suffix_threads,
                           storage=storage, dtype=self.dtype, column=self.column)
            self._adopt(prof)
            self.profile_seconds = time.perf_counter() - t

    # --- iterating -----------------------------------------------------------------------------

    def iter_shards(self, shards: list[str] | None = None):
        """The features of each shard of `shards` (default: this rank's and worker's), in order,
        fetched `prefetch` ahead: `(index, Features)` with the suffix already run."""
        shards = self.shards() if shards is None else shards
        if not shards:
            return
        self._turns = turns = _Turns()
        self._sends = sends = _Turns()
        # The gateway numbers this pass's requests in shard order, however their connections
        # reach it (`seq`, ADR 0021).
        self._stream = secrets.token_hex(8)
        self._runs = runs = _Turns(self.suffix_runs)
        pool = cf.ThreadPoolExecutor(self.prefetch)
        pending: deque = deque()
        next_shard = 0

        def submit():
            nonlocal next_shard
            while next_shard < len(shards) and len(pending) < self.prefetch:
                if self.overlap:
                    pending.append(pool.submit(self._fetch, next_shard, shards[next_shard], self.split))
                else:  # fetched when asked for, in this thread
                    pending.append(_Deferred(self._fetch, next_shard, shards[next_shard], self.split))
                next_shard += 1

        try:
            storage = None
            if self.requested_split == "auto" and self.planning and not self.plans and self.overlap:
                # Speculation: the storage node starts shard 0 while this side profiles (otherwise
                # both would wait for the plan), at the split with the fewest bytes (the plan on a
                # slow link). Any split's output serves: the suffix matches what ran. When the plan
                # is another split, shard 0 still ran on the otherwise idle storage tier, and it
                # reads outside the transfer order so that it holds nothing up.
                storage = self.client.storage(self.model, self.dtype)
                fewest = min(reversed(storage["splits"]), key=lambda s: s["bytes_per_sample"])["split"]
                turns.next = sends.next = 1
                pending.append(pool.submit(self._fetch, 0, shards[0], fewest))
                next_shard = 1
            self._start(shards, storage)
            submit()
            done = 0
            while pending:
                got = pending.popleft().result()
                done += 1
                self._maybe_replan(done)
                if self.overlap:
                    submit()
                yield done - 1, got
                if not self.overlap:
                    submit()
        finally:
            for f in pending:
                f.cancel()
            for t in (turns, sends, runs):
                t.close()
            pool.shutdown(wait=True, cancel_futures=True)

    def __iter__(self):
        feats, labels, keys = [], [], []
        have = 0
        index = -1
        for index, got in self.iter_shards():
            feats.append(got.features)
            if got.labels is not None:
                labels.append(got.labels)
            keys += got.keys
            have += len(got.features)
            while have >= self.batch_size:
                yield self._emit(feats, labels, keys, self.batch_size, index)
                have -= self.batch_size
        if have and not self.drop_last:
            yield self._emit(feats, labels, keys, have, index)

    def _emit(self, feats, labels, keys, n, shard):
        all_f = np.concatenate(feats) if len(feats) > 1 else feats[0]
        out_f, rest_f = all_f[:n], all_f[n:]
        feats[:] = [rest_f] if len(rest_f) else []
        out_l = None
        if labels:
            all_l = np.concatenate(labels)
            out_l, rest_l = all_l[:n], all_l[n:]
            labels[:] = [rest_l] if len(rest_l) else []
        out_k = keys[:n]
        del keys[:n]
        self.events.append(("yield", shard, time.perf_counter()))
        return out_f, out_l, out_k


class _Turns:
    """Shards take turns, in shard order, `width` at a time: shard i may start once every shard
    up to i - width is done (with a width of 1, strictly one after another). Bodies are read one
    at a time: requests go out `prefetch` ahead (so the storage node works ahead), but the link
    carries shard i before shard i+1 instead of splitting between them, so the first batch
    arrives as soon as one shard can cross, not all of them. The same holds for the compute
    tier's cores and the suffixes."""

    def __init__(self, width: int = 1):
        self.next, self.width, self.closed = 0, width, False
        self.finished: set[int] = set()  # done, after `next`
        self.cond = threading.Condition()

    def wait(self, index: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.closed or index < self.next + self.width)

    def done(self, index: int) -> None:
        with self.cond:
            if index >= self.next:
                self.finished.add(index)
            while self.next in self.finished:
                self.finished.discard(self.next)
                self.next += 1
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _cores() -> int:
    """The cores this process may run on (its affinity where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def link_rate(fetches) -> float | None:
    """Bytes per second the link delivered to `fetches`: their bytes over the time at least one of
    their bodies was arriving. Transfers in flight together share the link, so dividing by the sum
    of their times (or averaging per-request rates) would undercount it by the overlap."""
    spans = sorted((f.body_started, f.body_ended) for f in fetches if f.body_ended > f.body_started)
    if not spans:
        return None
    busy, (start, end) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > end:
            busy, start, end = busy + end - start, a, b
        else:
            end = max(end, b)
    busy += end - start
    return sum(f.bytes for f in fetches if f.body_ended > f.body_started) / busy


class _Deferred:
    """A fetch run only when its result is asked for (no overlap)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def result(self):
        return self.fn(*self.args)

    def cancel(self):
        return True
