"""Unit tests of the PyTorch datasets' pure parts (epoch assignment, the shuffle buffer, pickling,
rank discovery): no gateway, no store, no network."""

import json

from tensorgate import Client
from tensorgate.data import MemberDataset, ObjectDataset, ShardDataset, assign, epoch_order, split_slices
from tensorgate.loader import ShardLoader

SIZES = [6, 3, 5, 4, 2]  # uneven shards: 20 samples
BUCKET = "torchdata"
MODEL, SPLIT = "tiny-cnn", "block2"


def test_epoch_assignment_is_equal_per_rank_and_worker_and_covers_once():
    counts = dict(zip("abcde", SIZES))
    for shuffle in (False, True):
        order = epoch_order(list(counts), 3, 7, shuffle)
        ranks = [assign(order, counts, r, 3, True) for r in range(3)]
        sizes = [sum(s.stop - s.start for s in r) for r in ranks]
        assert sizes == [6, 6, 6]
        rows = [(s.key, i) for r in ranks for s in r for i in range(s.start, s.stop)]
        assert len(rows) == len(set(rows)) == 18
        for r in ranks:  # workers take whole batches of 4: 2 batches each rank, whatever the slices
            per = [sum(s.stop - s.start for s in split_slices(r, counts, w, 2, 4)) for w in range(2)]
            assert per == [4, 2]
    padded = [assign(list(counts), counts, r, 3, False) for r in range(3)]
    assert [sum(s.stop - s.start for s in r) for r in padded] == [7, 7, 7]
    assert padded[2][-1].key == "a" and padded[2][-1].start == 0  # padding wraps to the start
    assert epoch_order(list(counts), 1, 7, True) != epoch_order(list(counts), 2, 7, True)
    # Without counts: whole shards, as many per rank.
    assert [len(assign(list(counts), None, r, 2, True)) for r in range(2)] == [2, 2]
    assert [len(assign(list(counts), None, r, 2, False)) for r in range(2)] == [3, 3]


def test_the_shuffle_buffer_resumes_exactly_from_any_point_including_its_drain():
    from tensorgate.data import _Buffer

    def run(stop=None, state=None):
        buf, out, taken = _Buffer(5, [1, 2]), [], 0
        if state:
            buf.rng.bit_generator.state, buf.items, taken = state["rng"], [tuple(i) for i in state["items"]], state["taken"]

        def stream():
            nonlocal taken
            for i in range(taken, 20):
                taken += 1
                if (x := buf.push((i, i))) is not None:
                    yield x
            yield from buf.drain()

        for x in stream():
            out.append(x[0])
            if len(out) == stop:
                return out, json.loads(json.dumps({"rng": buf.rng.bit_generator.state, "taken": taken,
                                                   "items": [list(i) for i in buf.items]}))
        return out, None

    whole, _ = run()
    assert sorted(whole) == list(range(20)) and whole != list(range(20))
    for k in range(1, 20):  # the last 4 stops fall in the drain
        head, state = run(stop=k)
        assert head + run(state=state)[0] == whole, k


def test_datasets_touch_no_network_before_iteration_and_pickle_as_plain_settings():
    import pickle

    from tensorgate import Endpoint

    nowhere = Endpoint("http://127.0.0.1:9", "ak", "sk", admin="http://127.0.0.1:9")
    for ds in (ShardDataset(nowhere, BUCKET, MODEL, "auto", prefix="wds/", shuffle=True),
               ObjectDataset(nowhere, BUCKET, ["a.npy"], MODEL, SPLIT),
               MemberDataset(nowhere, BUCKET, MODEL, SPLIT, counts={"wds/000.tar": 2})):
        back = pickle.loads(pickle.dumps(ds))
        assert back.endpoint == nowhere and back._local is None
    live = Client("http://127.0.0.1:9", "ak", "sk")
    assert pickle.loads(pickle.dumps(ShardDataset(live, BUCKET, MODEL, SPLIT))).endpoint == live.config


def test_a_loader_becomes_a_dataset_with_the_settings_it_was_given():
    nowhere = Client("http://127.0.0.1:9", "ak", "sk")
    loader = ShardLoader(nowhere, BUCKET, "wds/", MODEL, SPLIT, 4, rank=1, world_size=2, prefetch=3, drop_last=True,
                         dtype="f16", suffix_runs=2)
    ds = ShardDataset.from_loader(loader)
    assert (ds.bucket, ds.prefix, ds.model, ds.split, ds.batch_size) == (BUCKET, "wds/", MODEL, SPLIT, 4)
    assert ds.rank_world() == (1, 2) and ds.drop_last and ds.dtype == "f16"


def test_ranks_outside_a_process_group_are_the_only_rank_and_worker():
    from tensorgate.ranks import distributed, worker

    assert distributed() is None and worker() == (0, 1)
