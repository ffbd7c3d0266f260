"""What the engines of one gateway reserve and hold: five engines (ResNet-18 `layer1` and `pool`,
PP-LCNet `pool`, ResNet-50-thin `pool` and `stage1`; the default two workers and `max_batch` 16),
32 requests each of `.npy` shards of 1-8 samples in a seeded order, then `/v1/memory` and the
process's `VmRSS`. Compares `pushdown.ort_arena` `"off"`, `"per-run"` (the default; ADR 0012, 0015) and
`"kept"` (ADR 0011), and per engine what it reserves and what the model predicts for the traffic
it saw against the process's measured peak growth.

    .venv/bin/python bench/engine_memory.py                 # both settings, 4 GiB budget
    BUDGET=1073741824 .venv/bin/python bench/engine_memory.py   # the default budget: engines refused

Uses the test suite's gateway launcher (tests/python/conftest.py; TENSORGATE_BIN picks the binary)."""

import json
import os
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "python"))

import numpy as np  # noqa: E402
import urllib3  # noqa: E402
from conftest import run_gateway  # noqa: E402
from test_memory import NO_CACHE, npy_shard, presigned, rss, sigv4  # noqa: E402

ENGINES = [("resnet18", "layer1", (3, 224, 224)), ("resnet18", "pool", (3, 224, 224)),
           ("pp-lcnet", "pool", (3, 224, 224)), ("resnet50-thin", "pool", (224, 224, 3)),
           ("resnet50-thin", "stage1", (224, 224, 3))]
BUDGET = int(os.environ.get("BUDGET", 4 << 30))


def measure(arena: str, tmp: Path) -> None:
    cfg = f"[pushdown]\nort_arena = \"{arena}\"\nmemory_budget = {BUDGET}\n" + NO_CACHE
    with run_gateway(tmp, cfg) as (_, admin, s3, pid):
        rng = np.random.default_rng(5)
        for shape in {e[2] for e in ENGINES}:
            for n in range(1, 9):
                samples = [rng.random(shape, dtype=np.float32) for _ in range(n)]
                s3.put_object(Bucket="demo", Key=f"m/{shape[0]}-{n}.tar", Body=npy_shard(samples))
        signer, http = sigv4(s3), urllib3.PoolManager()
        before = rss(pid, "VmRSS:")
        refused, grown = [], {}
        for model, split, shape in ENGINES:
            # Each engine's own growth: the process's peak over its start and its requests (one
            # at a time, so one worker runs), above what the engines before it left resident.
            # The first request starts the engine (the prefix cut, the check against the full
            # model, the probes): its peak is the start's; the other 31 are the engine serving.
            start = rss(pid, "VmRSS:")
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            largest, start_peak = 0, None
            for i in range(32):
                n = int(rng.integers(1, 9))
                largest = max(largest, n)
                r = http.request("GET", presigned(signer, "demo", f"m/{shape[0]}-{n}.tar"),
                                 headers={"x-tensorgate-model": model, "x-tensorgate-split": split})
                if r.status != 200:
                    refused.append(f"{model} {split}: {r.status} {r.data[:160]!r}")
                    break
                if i == 0:
                    start_peak = rss(pid, "VmHWM:") - start
                    Path(f"/proc/{pid}/clear_refs").write_text("5")
            grown[(model, split)] = (start_peak, rss(pid, "VmHWM:") - start, largest)
        with urllib.request.urlopen(f"{admin}/v1/memory") as resp:
            report = json.load(resp)
        after = rss(pid, "VmRSS:")
    engines = [e for e in report["engines"] if e.get("reserved_bytes")]
    reserved = sum(e["reserved_bytes"] for e in engines)
    print(f"| {arena} | {len(engines)} | {reserved / 1e6:.0f} MB | {after / 1e6:.0f} MB "
          f"| {(after - before) / 1e6:.0f} MB | "
          + ", ".join(f"{e['model']} {e['split']} {e['reserved_bytes'] / 1e6:.0f} MB" for e in engines) + " |")
    for r in refused:
        print(f"  refused: {r}")
    for e in engines:
        start_peak, peak, largest = grown[(e["model"], e["split"])]
        m = e["memory"]
        # What the model says the process needs for this traffic: every worker's session and the
        # prefix the engine keeps, one run of the largest batch seen (its workspace and
        # activations), plus that request's samples queued and held.
        sessions = e["workers"] * m["session_bytes"] + m["prefix_bytes"]
        run = m["fixed_bytes"] - m["session_bytes"] + largest * m["activation_bytes_per_sample"]
        held = largest * (m["queued_bytes_per_sample"] + m["held_bytes_per_sample"])
        model_peak = sessions + run + held
        PER_ENGINE.append(f"| {arena} | {e['model']} | {e['split']} | {e['reserved_bytes'] / 1e6:.0f} | "
                          f"{start_peak / 1e6:.0f} | {peak / 1e6:.0f} | {e['reserved_bytes'] / max(peak, 1):.2f} | "
                          f"{largest} | {model_peak / 1e6:.0f} | {model_peak / max(peak, 1):.2f} |")


PER_ENGINE: list[str] = []


def main() -> None:
    print(f"Budget {BUDGET / 1e6:.0f} MB.\n")
    print("| arena | engines started | engines reserved | resident after | resident growth | per engine, reserved |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for arena in ("off", "per-run", "kept"):
            path = Path(tmp) / arena
            path.mkdir()
            measure(arena, path)
    print("\nPer engine: reserved (both workers at the batch cap), the process's peak growth over the"
          " engine's start (its first request) and while it serves (the other 31, one at a time), and"
          " the model's prediction for that traffic (its sessions and prefix, one run of the largest batch,"
          " that request's samples).\n")
    print("| arena | model | split | reserved MB | start peak MB | serving peak MB | reserved / serving "
          "| largest batch | model's peak MB | model / serving |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(PER_ENGINE))


if __name__ == "__main__":
    main()
