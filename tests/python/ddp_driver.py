"""Data-parallel training as users run it, for tests/python/test_ddp.py: two ranks started with
`torch.multiprocessing.spawn`, a gloo process group on loopback, and every dataset class of
`tensorgate.data` read through DataLoader workers started with `spawn` and with `fork` (and through
torchdata.nodes pipelines), for two epochs, with no rank or world size given to any dataset. Then the job stops mid-epoch, saving each
rank's StatefulDataLoader state, and a second job (new processes, new process group) resumes from it.

Usage: python ddp_driver.py OUT_DIR. The gateway and data are named by the environment (TG_URL,
TG_KEY, TG_SECRET, TG_ADMIN, TG_BUCKET, TG_MODEL, TG_SPLIT, MASTER_PORT). Each rank writes what it
saw to OUT_DIR/<phase>-<rank>.json; the test asserts on it."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from tensorgate import Client
from tensorgate.data import MemberDataset, ObjectDataset, ShardDataset

WORLD = 2
EPOCHS = 2
#: Batches each rank takes before the job stops (its checkpoint is mid-epoch).
BEFORE_STOP = 2


def env(name: str) -> str:
    return os.environ[name]


def client() -> Client:
    return Client(env("TG_URL"), env("TG_KEY"), env("TG_SECRET"), admin=env("TG_ADMIN"))


def shards(**kw) -> ShardDataset:
    return ShardDataset(client(), env("TG_BUCKET"), env("TG_MODEL"), env("TG_SPLIT"), prefix="train/",
                        index="train/shards.json", **kw)


def resumable() -> StatefulDataLoader:
    ds = shards(batch_size=3, shuffle=True, seed=9, shuffle_buffer=5)
    ds.set_epoch(1)
    return StatefulDataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")


def keys_of(batch) -> list[str]:
    return list(batch["key"])


def join(rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)


def run(rank: int, out: str) -> None:
    # Built before the process group exists: only pickling it into the workers can carry the rank.
    early = shards(shuffle=True, seed=3)
    join(rank)
    late = shards(shuffle=True, seed=4, drop_last=True)
    seen: dict = {}
    # Persistent workers are started once: set_epoch must still reach them.
    persistent = shards(shuffle=True, seed=7)
    for name, ds, ctx in (("shard-spawn", early, "spawn"), ("shard-fork", late, "fork"),
                          ("shard-persistent", persistent, "spawn")):
        loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=ctx,
                            persistent_workers=ds is persistent)
        seen[name] = []
        for epoch in range(EPOCHS):
            ds.set_epoch(epoch)
            seen[name].append({"len": len(ds), "batches": [keys_of(b) for b in loader]})
    objects = json.loads(env("TG_OBJECTS"))
    maps = {
        "object": lambda: ObjectDataset(client(), env("TG_BUCKET"), objects, env("TG_MODEL"), env("TG_SPLIT"),
                                        labels=list(range(len(objects)))),
        "member": lambda: MemberDataset(client(), env("TG_BUCKET"), env("TG_MODEL"), env("TG_SPLIT"),
                                        index="train/shards.json"),
    }
    for name, make in maps.items():
        for ctx in ("spawn", "fork"):
            ds = make()
            sampler = DistributedSampler(ds, shuffle=True, seed=5)  # rank and world from the process group
            loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, multiprocessing_context=ctx,
                                persistent_workers=ctx == "spawn")
            seen[f"{name}-{ctx}"] = []
            for epoch in range(EPOCHS):
                sampler.set_epoch(epoch)
                seen[f"{name}-{ctx}"].append({"len": len(sampler), "batches": [keys_of(b) for b in loader]})
    # torchdata.nodes, the successor of DataPipes: the iterable dataset wrapped as a node (its
    # state_dict is the dataset's), and a map-style one behind a sampler and a process mapper.
    from torchdata.nodes import Batcher, IterableWrapper, Loader, ParallelMapper, SamplerWrapper

    def shard_nodes():
        ds = shards(shuffle=True, seed=6)
        return ds, Loader(Batcher(IterableWrapper(ds), batch_size=4, drop_last=False))

    ds, loader = shard_nodes()
    seen["nodes-shard"] = []
    for epoch in range(EPOCHS):
        ds.set_epoch(epoch)
        seen["nodes-shard"].append({"len": len(ds), "batches": [[i["key"] for i in b] for b in loader]})
    ds, loader = shard_nodes()
    ds.set_epoch(1)
    it = iter(loader)
    head = [[i["key"] for i in next(it)] for _ in range(BEFORE_STOP)]
    state = loader.state_dict()
    ds, again = shard_nodes()
    again.load_state_dict(state)
    seen["nodes-resume"] = {"head": head, "rest": [[i["key"] for i in b] for b in again]}
    ds = maps["object"]()
    sampler = DistributedSampler(ds, shuffle=True, seed=5)
    mapped = ParallelMapper(SamplerWrapper(sampler), ds.__getitem__, num_workers=2, method="process",
                            multiprocessing_context="fork")
    loader = Loader(Batcher(mapped, batch_size=4, drop_last=False))
    seen["nodes-object"] = [{"len": len(sampler), "batches": [[i["key"] for i in b] for b in loader]}
                            for _ in range(EPOCHS)]  # SamplerWrapper moves the sampler's epoch on
    # The uninterrupted epoch, then the same epoch stopped after BEFORE_STOP batches: a checkpoint.
    seen["whole"] = [keys_of(b) for b in resumable()]
    first = resumable()
    it = iter(first)
    seen["head"] = [keys_of(next(it)) for _ in range(BEFORE_STOP)]
    torch.save(first.state_dict(), Path(out, f"checkpoint-{rank}.pt"))  # as a training checkpoint holds it
    del it, first
    dist.barrier()
    Path(out, f"run-{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def resume(rank: int, out: str) -> None:
    join(rank)
    state = torch.load(Path(out, f"checkpoint-{rank}.pt"), weights_only=False)
    loader = resumable()
    loader.load_state_dict(state)
    rest = [keys_of(b) for b in loader]
    dist.barrier()
    Path(out, f"resume-{rank}.json").write_text(json.dumps({"rest": rest}))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(run, args=(sys.argv[1],), nprocs=WORLD)
    torch.multiprocessing.spawn(resume, args=(sys.argv[1],), nprocs=WORLD)
