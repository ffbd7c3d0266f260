"""One epoch over a cluster's shards from the compute tier (run by bench/cluster/run.py inside the
compute namespace). Prints one JSON object: the epoch's seconds and bytes, and per shard the cache
status, the member that computed it, the member asked, a digest of the features and when the
request started and ended.

    client.py --admin URL --bucket B --keys k1,k2,... --route owner|spread [--model M --split S]
              [--threads T] [--warm KEY] [--kill-pid PID --kill-at I]

`--route owner`: the routed Python client (each GET to the object's rendezvous owner).
`--route spread`: a plain client per member, each GET to a member picked at random (a load balancer;
`--seed` picks, so give each epoch its own).
`--kill-pid`: SIGKILL that process as request I (in submission order) starts: a node lost mid-epoch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tensorgate import Client

KEY, SECRET = "cluster", "cluster-secret"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--admin", required=True)
    ap.add_argument("--bucket", required=True)
    ap.add_argument("--keys", required=True)
    ap.add_argument("--route", choices=["owner", "spread"], default="owner")
    ap.add_argument("--model")
    ap.add_argument("--split")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--kill-pid", type=int)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--warm", help="a key to push down on every member first, untimed")
    a = ap.parse_args()
    keys = a.keys.split(",")
    with urllib.request.urlopen(f"{a.admin}/v1/cluster", timeout=5) as r:
        members = json.load(r)["members"]
    s3 = members[0]["s3"]
    routed = Client(s3, KEY, SECRET, admin=a.admin, route=True)
    plain = {m["id"]: Client(m["s3"], KEY, SECRET) for m in members}
    pick = random.Random(a.seed)
    asked = {k: pick.choice(sorted(plain)) for k in keys} if a.route == "spread" else {}
    lock = threading.Lock()
    kill_time = None

    def one(i: int, key: str) -> dict:
        nonlocal kill_time
        if i == a.kill_at and a.kill_pid:
            with lock:
                os.kill(a.kill_pid, signal.SIGKILL)
                kill_time = time.monotonic()
        client = plain[asked[key]] if a.route == "spread" else routed
        start = time.monotonic()
        got = client.get(a.bucket, key, a.model, a.split, raw=a.model is None)
        digest = hashlib.sha256(np.ascontiguousarray(got.result.features).tobytes()).hexdigest()[:16]
        return {"key": key, "cache": got.cache, "by": got.computed_by, "asked": asked.get(key), "bytes": got.bytes,
                "digest": digest, "start": start, "end": time.monotonic()}

    for key in keys:
        routed._targets(a.bucket, key)  # membership read and a client per member, untimed
    if a.warm and a.model:
        for c in plain.values():
            c.get(a.bucket, a.warm, a.model, a.split)
    t0 = time.monotonic()
    with ThreadPoolExecutor(a.threads) as pool:
        rows = list(pool.map(one, range(len(keys)), keys))
    secs = time.monotonic() - t0
    for r in rows:
        r["start"] -= t0
        r["end"] -= t0
    json.dump({"seconds": secs, "bytes": sum(r["bytes"] for r in rows), "rows": rows,
               "kill_time": None if kill_time is None else kill_time - t0}, sys.stdout)


if __name__ == "__main__":
    main()
