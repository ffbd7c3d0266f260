"""PyTorch datasets over pushdown features.

- `ShardDataset`: an iterable dataset over WebDataset shards. Each epoch's shard order is a seeded
  permutation (`set_epoch`), split across data-parallel ranks and loader workers; an optional
  shuffle buffer mixes samples; `state_dict` / `load_state_dict` resume mid-epoch (torchdata's
  `StatefulDataLoader`); per-sample items or pre-batched ones.
- `ObjectDataset`: a map-style dataset, one object (image or `.npy`) per index.
- `MemberDataset`: a map-style dataset over the samples of shards, each read as a byte range of the
  shard's cached pushdown output (so a `DistributedSampler` in any order moves one sample per read).

All are picklable under the `spawn` start method: they hold plain settings (an `Endpoint`), and
each process builds its own client, sessions and threads when it first iterates. Nothing touches the
network before then. Items are dicts `{"features", "label", "key"}` (labels when the shards carry
`.cls` members), as torch tensors, or numpy arrays when torch is absent (or `tensors="numpy"`).

Equal work per rank (DDP needs every rank to run the same number of steps): with the shards'
sample counts (`counts=`, or `index=` naming a `shards.json` written by
`tensorgate.wds.write_index`), the epoch's sample sequence is cut into equal contiguous ranges, one
per rank (then one per worker): `drop_last=True` drops the last `N mod world_size` samples,
`drop_last=False` pads the last ranks with the first samples again. A shard on a boundary is read
by both sides, each keeping its own rows. Without counts, whole shards are dealt to ranks, and each
rank gets the same number of shards (dropping or repeating shards); batch counts are then equal
only if the shards hold equal sample counts.
"""

from __future__ import annotations

import io
import json
import os
import uuid
from dataclasses import dataclass

import numpy as np

from .client import Client, Endpoint
from .codec import array
from .loader import ShardLoader
from .ranks import distributed as _dist
from .ranks import worker as _where
from .suffix import NO_PUSHDOWN, preprocess
from .wds import SHARD_SUFFIXES, read_index

try:  # torch is optional: without it the datasets are plain iterables of numpy arrays
    import torch
    from torch.utils.data import Dataset as _MapBase
    from torch.utils.data import IterableDataset as _IterBase
except ImportError:  # pragma: no cover - exercised where torch is not installed
    torch = None
    _MapBase = _IterBase = object

#: Format tag of `state_dict()` (a resumed state of another layout is refused).
STATE_VERSION = 1


def _endpoint(source) -> Endpoint:
    if isinstance(source, Endpoint):
        return source
    if isinstance(source, Client):
        return source.config
    raise TypeError("source must be a tensorgate.Client or tensorgate.Endpoint")


def _plain_state(self) -> dict:
    """What a dataset pickles: its plain settings, never its process's client and threads."""
    state = dict(self.__dict__)
    state["_local"] = None
    return state


class _Ranked:
    """Rank and world size resolved where they are true: given explicitly, or read from
    `torch.distributed` in the process that builds the dataset or pickles it into its loader
    workers (the trainer's process), and carried to the workers in the pickle. A worker never
    reads them from its own, empty, process state (issue: every rank read the whole dataset)."""

    def _init_ranks(self, rank: int | None, world_size: int | None) -> None:
        self._rank, self._world = rank, world_size
        #: (rank, world size) seen in torch.distributed by the building or pickling process.
        self._dist_seen = _dist()

    def _ranks_for_pickle(self, state: dict) -> dict:
        """`state` with the ranks the pickling process sees (it is the trainer's, where
        torch.distributed is initialised; the worker it is sent to is not)."""
        seen = _dist()
        if seen is not None:
            state["_dist_seen"] = seen
        return state

    def rank_world(self) -> tuple[int, int]:
        """(rank, world size): explicit, else torch.distributed here, else what the process that
        built or pickled the dataset saw, else (0, 1)."""
        r, w = _dist() or self._dist_seen or (0, 1)
        rank = self._rank if self._rank is not None else r
        world = self._world if self._world is not None else w
        if not 0 <= rank < world:
            raise ValueError("rank must be in [0, world_size)")
        return rank, world


@dataclass(frozen=True)
class Slice:
    """Rows `[start, stop)` of shard `key` (`stop=None`: to its end, when counts are unknown)."""

    key: str
    start: int = 0
    stop: int | None = None


def epoch_order(keys: list[str], epoch: int, seed: int, shuffle: bool) -> list[str]:
    """The epoch's shard order: the keys, or their permutation seeded by (seed, epoch)."""
    if not shuffle:
        return list(keys)
    perm = np.random.default_rng([seed, epoch]).permutation(len(keys))
    return [keys[i] for i in perm]


def _cut(order: list[str], counts: dict[str, int], begin: int, end: int) -> list[Slice]:
    """Positions `[begin, end)` of the concatenated samples of `order` (wrapping past the end) as
    shard slices."""
    total = sum(counts[k] for k in order)
    out: list[Slice] = []
    pos = begin
    while pos < end and total:
        at, within = pos % total, 0
        for k in order:
            n = counts[k]
            if at < within + n:
                start = at - within
                stop = min(n, start + (end - pos))
                out.append(Slice(k, start, stop))
                pos += stop - start
                break
            within += n
    return out


def assign(order: list[str], counts: dict[str, int] | None, part: int, parts: int, drop_last: bool) -> list[Slice]:
    """Part `part` of `parts` of an epoch's samples (module docs): equal contiguous sample ranges
    when `counts` covers every shard, else every `parts`-th shard, equal in number."""
    if counts is not None:
        total = sum(counts[k] for k in order)
        each = total // parts if drop_last else -(-total // parts)
        return _cut(order, counts, part * each, (part + 1) * each)
    each = len(order) // parts if drop_last else -(-len(order) // parts)
    padded = [order[i % len(order)] for i in range(each * parts)] if order else []
    return [Slice(k) for k in padded[part::parts]]


def split_slices(slices: list[Slice], counts: dict[str, int] | None, part: int, parts: int,
                 unit: int = 1) -> list[Slice]:
    """A rank's slices split across its loader workers. With counts: contiguous runs of whole
    `unit`s (the batch size when pre-batched), as equal in number as they can be, so that a rank
    yields the same number of batches whatever its slices look like; else every `parts`-th slice."""
    if counts is None:
        return slices[part::parts]
    rows = [(s, (s.stop if s.stop is not None else counts[s.key]) - s.start) for s in slices]
    total = sum(n for _, n in rows)
    units = -(-total // unit)
    base, extra = divmod(units, parts)
    first = part * base + min(part, extra)
    begin, end = first * unit, min(total, (first + base + (1 if part < extra else 0)) * unit)
    out, pos = [], 0
    for s, n in rows:
        a, b = max(begin, pos), min(end, pos + n)
        if a < b:
            out.append(Slice(s.key, s.start + a - pos, s.start + b - pos))
        pos += n
    return out


def _row_group_shards(client, bucket: str, keys: list[str]) -> tuple[list[str], dict[str, int]]:
    """Every row group of the Parquet files `keys` as a shard, with its rows from the footers."""
    from .table import row_group_counts, row_group_unit

    units: dict[str, int] = {}
    for key in keys:
        if not key.endswith(".parquet"):
            raise ValueError(f"row_groups=True reads Parquet files; {key!r} is not one")
        for group, n in enumerate(row_group_counts(client, bucket, key)):
            units[row_group_unit(key, group)] = n
    return list(units), units


class _Buffer:
    """A shuffle buffer whose state is plain data: once `size` samples wait, each arrival swaps
    with a random waiting one and the last leaves; at the end the rest leave in random order."""

    def __init__(self, size: int, seed):
        self.size, self.rng, self.items = size, np.random.default_rng(seed), []

    def push(self, item):
        self.items.append(item)
        if len(self.items) < self.size:
            return None
        k = int(self.rng.integers(len(self.items)))
        self.items[k], self.items[-1] = self.items[-1], self.items[k]
        return self.items.pop()

    def drain(self):
        """The waiting items in random order, one at a time: the state stays exact while it drains
        (a checkpoint taken then still holds the ones not yet out)."""
        while self.items:
            k = int(self.rng.integers(len(self.items)))
            self.items[k], self.items[-1] = self.items[-1], self.items[k]
            yield self.items.pop()


class ShardDataset(_IterBase, _Ranked):
    """An iterable dataset of pushdown features over WebDataset shards or Parquet files (module
    docs).

    - `source`: a `Client` or `Endpoint` (only its plain settings are kept).
    - `keys` or `prefix`: the shards (listed at the first iteration when only a prefix is given:
      keys ending in `.tar` or `.parquet`). A Parquet file in Hugging Face `datasets`' layout is
      a shard whose rows are samples (`index`/`counts` from `write_index` count them from the
      footers); `column` names its image column (default `image`).
    - `row_groups`: each row group of a Parquet file is a shard of its own (`key#row-group=n`):
      shuffled, assigned to ranks and workers and fetched one row group per request (the
      gateway reads it by ranges), with exact counts from the footers (two ranged reads per file,
      once per process). For large files (`datasets` writes shards of up to 500 MB): memory,
      caching and shuffling go by row group instead of by file.
    - `split`: a split name, `"none"` (raw shards decoded here) or `"auto"`: one process of the job
      (rank 0, worker 0) profiles and posts the plan, once per job; every other one sends
      `split=auto` and the gateway applies that plan (each response names the split that ran, and
      the matching suffix runs here).
    - `batch_size`: `None` yields samples (let the `DataLoader` batch them); an int yields
      batches of that size (use `DataLoader(batch_size=None)`).
    - `shuffle` (shard order per epoch, seeded by `seed` and `set_epoch`), `shuffle_buffer`
      (samples; 0 keeps the order).
    - `counts` / `index`: sample counts per shard (module docs: equal batches per rank).
    - `rank` / `world_size`: default from `torch.distributed` in the process that builds the
      dataset or pickles it into its loader workers (`_Ranked`).
    - `drop_last`: equal per-rank sample counts by dropping (True) or padding (False); in
      pre-batched mode it also drops each worker's last partial batch.
    - `prefetch`, `storage_batch`, `local_cache_bytes`, `suffix_threads`, `suffix_runs`, `train_secs_per_batch`,
      `replan_threshold`, `replan_every`, `dtype`, `column`: as in `ShardLoader` (only the planning
      process re-plans).
    - `augment`: the recipe's random crops and flips (`tensorgate.Augment`, or
      `Augment.from_torchvision(transforms, seed)`): epoch `e` (`set_epoch`) draws with
      `augment.for_epoch(e)`, by the gateway or here where no pushdown ran, so ranks, workers and a
      resumed epoch see the same samples (ADR 0032).
    """

    def __init__(self, source, bucket: str, model: str, split: str, *, prefix: str = "",
                 keys: list[str] | None = None, batch_size: int | None = None, shuffle: bool = False,
                 seed: int = 0, shuffle_buffer: int = 0, counts: dict[str, int] | None = None,
                 index: str | None = None, rank: int | None = None, world_size: int | None = None,
                 drop_last: bool = False, prefetch: int = 4, storage_batch: int | None = None,
                 local_cache_bytes: int = 0, suffix_threads: int = 1, tensors: str | None = None,
                 train_secs_per_batch: float = 0.0, replan_threshold: float = 0.3, replan_every: int = 50,
                 dtype: str | None = None, column: str | None = None, row_groups: bool = False,
                 suffix_runs: int = 0, augment=None):
        self.endpoint = _endpoint(source)
        #: Random crops and flips (`tensorgate.augment.Augment`): epoch `e` draws with
        #: `augment.for_epoch(e)`, on every rank and worker alike, and a resumed epoch again.
        self.augment = augment
        self.row_groups = row_groups
        self.bucket, self.model, self.split, self.prefix = bucket, model, split, prefix
        self.keys = list(keys) if keys is not None else None
        self.batch_size, self.shuffle, self.seed, self.shuffle_buffer = batch_size, shuffle, seed, shuffle_buffer
        self.counts, self.index = (dict(counts) if counts is not None else None), index
        self._init_ranks(rank, world_size)
        self.drop_last = drop_last
        self.prefetch, self.storage_batch = prefetch, storage_batch
        self.local_cache_bytes, self.suffix_threads, self.suffix_runs = local_cache_bytes, suffix_threads, suffix_runs
        self.train_secs_per_batch, self.dtype, self.column = train_secs_per_batch, dtype, column
        self.replan = (replan_threshold, replan_every)
        self.tensors = tensors or ("torch" if torch is not None else "numpy")
        if self.tensors == "torch" and torch is None:
            raise ImportError("tensors='torch' needs torch installed")
        #: The epoch, shared with the loader workers: a shared-memory tensor with torch, so that
        #: `set_epoch` reaches workers started once (`persistent_workers=True`), which keep the
        #: copy of the dataset they were started with; a plain int without torch.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_() if torch is not None else 0
        #: Names this job's plan (split="auto"): one plan per job, whatever the workers' lifetimes.
        self.job = uuid.uuid4().hex
        self._resume: dict | None = None
        self._state: dict | None = None
        self._local = None  # per process: (pid, client, loader); never pickled

    # --- pickling: plain settings only ------------------------------------------------------

    def __getstate__(self):
        return self._ranks_for_pickle(_plain_state(self))

    def _process(self):
        if self._local is None or self._local[0] != os.getpid():
            self._local = (os.getpid(), self.endpoint.connect(), {})
        return self._local

    @property
    def client(self) -> Client:
        return self._process()[1]

    # --- the epoch's work --------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    @epoch.setter
    def epoch(self, value: int) -> None:
        if torch is not None and isinstance(self._epoch, torch.Tensor):
            self._epoch.fill_(int(value))
        else:
            self._epoch = int(value)

    @classmethod
    def from_loader(cls, loader: ShardLoader) -> ShardDataset:
        """A `ShardLoader` as a `torch.utils.data.IterableDataset` of pre-batched samples (use it
        with `DataLoader(batch_size=None)`): the same settings, picklable into workers."""
        rank, world_size, suffix_runs = loader._given
        return cls(loader.client, loader.bucket, loader.model, loader.requested_split, prefix=loader.prefix,
                   keys=loader.keys, batch_size=loader.batch_size, rank=rank, world_size=world_size,
                   drop_last=loader.drop_last, prefetch=loader.prefetch, storage_batch=loader.storage_batch,
                   local_cache_bytes=loader.local_cache_bytes, suffix_threads=loader.suffix_threads,
                   suffix_runs=suffix_runs, dtype=loader.dtype, column=loader.column)

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch (its shard permutation and shuffle seed). Call it before each epoch,
        on every rank, as with `DistributedSampler`; it reaches persistent loader workers too."""
        self.epoch = epoch

    def _shards(self) -> tuple[list[str], dict[str, int] | None]:
        cache = self._process()[2]
        if "keys" not in cache:
            keys = self.keys if self.keys is not None else self.client.list_keys(self.bucket, self.prefix,
                                                                                  SHARD_SUFFIXES)
            counts = self.counts
            if counts is None and self.index is not None:
                counts = read_index(self.client, self.bucket, self.index)
            if self.row_groups:
                keys, counts = _row_group_shards(self.client, self.bucket, keys)
            if counts is not None:
                missing = [k for k in keys if k not in counts]
                if missing:
                    raise ValueError(f"no sample count for shard {missing[0]!r} (counts/index)")
            cache["keys"], cache["counts"] = keys, counts
        return cache["keys"], cache["counts"]

    def slices(self, epoch: int | None = None) -> list[Slice]:
        """What this rank's worker reads in `epoch` (default: the current one), in order."""
        keys, counts = self._shards()
        rank, world = self.rank_world()
        worker, workers = _where()
        order = epoch_order(keys, self.epoch if epoch is None else epoch, self.seed, self.shuffle)
        mine = assign(order, counts, rank, world, self.drop_last)
        return split_slices(mine, counts, worker, workers, self.batch_size or 1)

    def __len__(self) -> int:
        """Items this rank yields per epoch (all its workers together); needs sample counts."""
        keys, counts = self._shards()
        if counts is None:
            raise TypeError("the length is known only with sample counts (counts= or index=)")
        rank, world = self.rank_world()
        mine = assign(epoch_order(keys, self.epoch, self.seed, self.shuffle), counts, rank, world, self.drop_last)
        n = sum(s.stop - s.start for s in mine)
        if self.batch_size is None:
            return n
        # Workers take whole batches (split_slices), so only the rank's last batch is partial.
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    # --- fetching ----------------------------------------------------------------------------

    def _is_planner(self) -> bool:
        return self.rank_world()[0] == 0 and _where()[0] == 0

    def _loader(self):
        from .suffix import cache_dir

        cache = self._process()[2]
        if "loader" not in cache:
            plan = False
            if self.split == "auto" and self._is_planner():
                marker = cache_dir() / f"plan-{self.job}.json"
                plan = not marker.exists()
                cache["plan_marker"] = marker
            cache["loader"] = ShardLoader(
                self.client, self.bucket, self.prefix, self.model, self.split, self.batch_size or 1,
                prefetch=self.prefetch, storage_batch=self.storage_batch, suffix_threads=self.suffix_threads,
                suffix_runs=self.suffix_runs, local_cache_bytes=self.local_cache_bytes, keys=[], plan=plan,
                train_secs_per_batch=self.train_secs_per_batch, replan_threshold=self.replan[0],
                replan_every=self.replan[1], dtype=self.dtype, column=self.column)
        return cache["loader"]

    def _shard_features(self, loader, keys: list[str]):
        """Each key's features (in order, prefetched), as this dataset's tensor type."""
        for _, f in loader.iter_shards(keys):
            if loader.plans and "plan_marker" in self._process()[2]:
                marker = self._process()[2].pop("plan_marker")
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.write_text(json.dumps(loader.plans[-1]["plan"]["chosen"]))
            feats = f.features
            if self.tensors == "torch":
                feats = torch.from_numpy(np.ascontiguousarray(feats) if feats.flags.writeable else feats.copy())
                labels = torch.from_numpy(f.labels.copy()) if f.labels is not None else None
            else:
                labels = f.labels
            yield feats, labels, f.keys

    def _samples(self, slices: list[Slice], skip: int):
        """(slice index, row, item) for every sample of `slices` after the first `skip`."""
        before, start = 0, 0
        for i, s in enumerate(slices):
            n = None if s.stop is None else s.stop - s.start
            if n is not None and before + n <= skip:
                before += n
                start = i + 1
                continue
            break
        rest = slices[start:]
        loader = self._loader()
        for (i, s), (feats, labels, keys) in zip(enumerate(rest, start), self._shard_features(loader, [s.key for s in rest])):
            stop = len(feats) if s.stop is None else min(s.stop, len(feats))
            first = s.start + max(0, skip - before)
            before += stop - s.start
            for row in range(first, stop):
                yield i, row - s.start, self._item(feats, labels, keys, row)

    def _item(self, feats, labels, keys, row):
        item = {"features": feats[row], "key": keys[row]}
        if labels is not None:
            item["label"] = labels[row]
        return item

    def _restore_buffer(self, slices: list[Slice], refs: list[list[int]]):
        """The items a saved shuffle buffer held, fetched again (one read per shard involved)."""
        wanted: dict[int, list[int]] = {}
        for i, row in refs:
            wanted.setdefault(i, []).append(row)
        got = {}
        order = sorted(wanted)
        for i, (feats, labels, keys) in zip(order, self._shard_features(self._loader(), [slices[i].key for i in order])):
            for row in wanted[i]:
                got[(i, row)] = self._item(feats, labels, keys, slices[i].start + row)
        return [((i, row), got[(i, row)]) for i, row in refs]

    # --- iterating ---------------------------------------------------------------------------

    def __iter__(self):
        epoch = self.epoch  # read once: the trainer may select the next one while this one drains
        slices = self.slices(epoch)
        self._loader().augment = self.augment.for_epoch(epoch) if self.augment else None
        resume, self._resume = self._resume, None
        if resume and resume["epoch"] != epoch:  # another epoch was selected since
            resume = None
        taken = resume["taken"] if resume else 0
        yielded = resume["yielded"] if resume else 0
        rank, _ = self.rank_world()
        buf = _Buffer(self.shuffle_buffer, [self.seed, epoch, rank, _where()[0]]) if self.shuffle_buffer else None
        if buf and resume:
            buf.rng.bit_generator.state = resume["rng"]
            buf.items = self._restore_buffer(slices, resume["buffer"])

        def save(done=False):
            self._state = {"version": STATE_VERSION, "epoch": epoch, "taken": taken, "yielded": yielded,
                           "done": done, "buffer": [list(ref) for ref, _ in buf.items] if buf else [],
                           "rng": buf.rng.bit_generator.state if buf else None}

        def ordered():
            nonlocal taken
            for i, row, item in self._samples(slices, taken):
                taken += 1
                if buf is None:
                    yield item
                    continue
                out = buf.push(((i, row), item))
                if out is not None:
                    yield out[1]
            if buf is not None:
                for _, item in buf.drain():
                    yield item

        save()
        if self.batch_size is None:
            for item in ordered():
                yielded += 1
                save()
                yield item
        else:
            batch = []
            for item in ordered():
                batch.append(item)
                if len(batch) == self.batch_size:
                    yielded += len(batch)
                    save()
                    yield self._collate(batch)
                    batch = []
            if batch and not self.drop_last:
                yielded += len(batch)
                save()
                yield self._collate(batch)
        save(done=True)

    def _collate(self, items: list[dict]) -> dict:
        stack = torch.stack if self.tensors == "torch" else np.stack
        out = {"features": stack([i["features"] for i in items]), "key": [i["key"] for i in items]}
        if "label" in items[0]:
            out["label"] = stack([i["label"] for i in items])
        return out

    # --- resuming (torchdata's Stateful protocol) --------------------------------------------

    def state_dict(self) -> dict:
        """Where this process's iteration stands: the epoch, the samples consumed and yielded,
        and the shuffle buffer (as shard rows) with its generator. Plain data."""
        if self._state is None:
            return {"version": STATE_VERSION, "epoch": self.epoch, "taken": 0, "yielded": 0, "done": False,
                    "buffer": [], "rng": None}
        return json.loads(json.dumps(self._state))

    def load_state_dict(self, state: dict) -> None:
        """Resumes the next iteration where `state` was taken: the same epoch, exactly the
        remaining items in the same order. A state taken at the end of an epoch starts the next
        epoch fresh."""
        if state.get("version") != STATE_VERSION:
            raise ValueError("a state_dict of another layout")
        self.epoch = state["epoch"]
        self._resume = None if state.get("done") else dict(state)
        self._state = dict(state)


class ObjectDataset(_MapBase):
    """A map-style dataset: item `i` is the pushdown output of object `keys[i]` (one image or
    `.npy` sample), with `labels[i]` (a sequence, a dict by key, or a callable of the key) when
    given. Works with any sampler (`DistributedSampler` included). `augment` and `set_epoch`: as
    in `ShardDataset`."""

    def __init__(self, source, bucket: str, keys: list[str], model: str, split: str, *, labels=None,
                 dtype: str | None = None, tensors: str | None = None, augment=None):
        self.endpoint, self.bucket, self.keys = _endpoint(source), bucket, list(keys)
        self.model, self.split, self.labels, self.dtype = model, split, labels, dtype
        self.tensors = tensors or ("torch" if torch is not None else "numpy")
        #: Random crops and flips (`tensorgate.augment.Augment`), epoch `e` drawn with
        #: `augment.for_epoch(e)` (`set_epoch`, shared with the loader's workers as ShardDataset's).
        self.augment = augment
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_() if torch is not None else 0
        self._local = None

    __getstate__ = _plain_state
    _process = ShardDataset._process
    client = ShardDataset.client
    epoch = ShardDataset.epoch
    set_epoch = ShardDataset.set_epoch

    def __len__(self) -> int:
        return len(self.keys)

    def _info(self) -> dict:
        cache = self._process()[2]
        if "info" not in cache:
            cache["info"] = self.client.models()[self.model]
        return cache["info"]

    def _label(self, i: int):
        if self.labels is None:
            return None
        if callable(self.labels):
            return self.labels(self.keys[i])
        if isinstance(self.labels, dict):
            return self.labels[self.keys[i]]
        return self.labels[i]

    def _runner(self, split: str):
        from .suffix import SuffixRunner

        runners = self._process()[2].setdefault("runners", {})
        if split not in runners:
            runners[split] = SuffixRunner(self.client, self.model, split)
        return runners[split]

    def __getitem__(self, i: int) -> dict:
        key = self.keys[i]
        aug = self.augment.for_epoch(self.epoch) if self.augment else None
        got = self.client.get(self.bucket, key, self.model, self.split, dtype=self.dtype, fmt="npy", augment=aug)
        ran = got.split or self.split
        if ran == NO_PUSHDOWN:  # split=auto planned as no pushdown: the object itself
            raw = got.result.features.tobytes()
            if raw[:6] == b"\x93NUMPY":
                x = np.load(io.BytesIO(raw), allow_pickle=False).astype(np.float32)
            else:
                x = preprocess(raw, self._info(), aug, key)
        else:
            x = got.result.features
        feats = self._runner(ran)(x[None])[0]
        return _as_item(feats, self._label(i), key, self.tensors)


class MemberDataset(_MapBase):
    """A map-style dataset over the samples of shards: item `i` is sample `i` of the shards in key
    order, read as a byte range of the shard's safetensors pushdown output (the gateway computes a
    shard once and serves later ranges from its cache). Needs the sample counts (`counts` or a
    `shards.json` `index`). The features are at the split that ran (the suffix runs here)."""

    def __init__(self, source, bucket: str, model: str, split: str, *, keys: list[str] | None = None,
                 counts: dict[str, int] | None = None, index: str | None = None, tensors: str | None = None):
        if split == "auto":
            raise ValueError("MemberDataset needs a fixed split (ranges of one output)")
        self.endpoint, self.bucket, self.model, self.split = _endpoint(source), bucket, model, split
        self._keys, self._counts, self.index = keys, counts, index
        self.tensors = tensors or ("torch" if torch is not None else "numpy")
        self._local = None

    __getstate__ = _plain_state
    _process = ShardDataset._process
    client = ShardDataset.client
    _runner = ObjectDataset._runner

    def _table(self):
        cache = self._process()[2]
        if "table" not in cache:
            counts = self._counts
            if counts is None:
                if self.index is None:
                    raise ValueError("MemberDataset needs counts= or index=")
                counts = read_index(self.client, self.bucket, self.index)
            keys = self._keys if self._keys is not None else sorted(counts)
            cache["table"] = (keys, np.cumsum([0] + [counts[k] for k in keys]))
        return cache["table"]

    def __len__(self) -> int:
        return int(self._table()[1][-1])

    def _layout(self, key: str) -> dict:
        """The safetensors header of `key`'s output: where each row lies, the labels, the keys."""
        cache = self._process()[2].setdefault("layouts", {})
        if key not in cache:
            raw = self._range(key, 0, 65535)
            n = int.from_bytes(raw[:8], "little")
            if 8 + n > len(raw):
                raw = self._range(key, 0, 8 + n - 1)
            header = json.loads(raw[8 : 8 + n])
            meta = header.pop("__metadata__", {}) or {}
            layout = {"data": 8 + n, "features": header["features"], "split": meta.get("split", self.split),
                      "keys": json.loads(meta.get("keys", "[]")), "labels": None}
            if "labels" in header:
                a, b = header["labels"]["data_offsets"]
                layout["labels"] = np.frombuffer(self._range(key, 8 + n + a, 8 + n + b - 1), dtype=np.int64)
            cache[key] = layout
        return cache[key]

    def _range(self, key: str, first: int, last: int) -> bytes:
        """Bytes `first..=last` of `key`'s safetensors output (undecoded)."""
        return self.client.get(self.bucket, key, self.model, self.split, fmt="safetensors",
                               range=f"bytes={first}-{last}", raw=True).result.features.tobytes()

    def __getitem__(self, i: int) -> dict:
        keys, starts = self._table()
        if not 0 <= i < starts[-1]:
            raise IndexError(i)
        s = int(np.searchsorted(starts, i, side="right")) - 1
        key, row = keys[s], i - int(starts[s])
        lay = self._layout(key)
        info = lay["features"]
        shape, dtype = info["shape"][1:], info["dtype"]
        width = (2 if dtype in ("F16", "BF16") else 4) * int(np.prod(shape))
        a = lay["data"] + info["data_offsets"][0] + row * width
        feats = array(self._range(key, a, a + width - 1), dtype)
        feats = self._runner(lay["split"])(feats.reshape(shape)[None])[0]
        label = lay["labels"][row] if lay["labels"] is not None else None
        return _as_item(feats, label, lay["keys"][row] if lay["keys"] else f"{key}#{row}", self.tensors)


def _as_item(feats: np.ndarray, label, key: str, tensors: str) -> dict:
    if tensors == "torch":
        feats = torch.from_numpy(np.array(feats))
        label = torch.tensor(int(label)) if label is not None else None
    item = {"features": feats, "key": key}
    if label is not None:
        item["label"] = label
    return item
