"""Re-decides the reproduction's recorded plans under other cost models, against what every option
measured in the same configuration (docs/REPRODUCTION.md, "Other cost models, re-evaluated").

Each `auto` run records its first plan's inputs (the client profile and the gateway's storage
terms; `bench/repro/trainer.py` since the timelines). Each model below predicts every candidate's
epoch from exactly those inputs, picks as the gateway does (the argmin, `none` unless a split is
predicted `PUSHDOWN_MARGIN` faster), and the pick is scored against the measured first epochs of
the fixed options (`images`, `split:*`) of the same model, batch and rate: best or within 5%.
`stages` is the gateway's model since ADR 0025, `hapi` before it (src/planner.rs): the one a
recording was planned with must reproduce its recorded predictions, which is checked (a profile
with `samples_per_request` was planned with `stages`, at that unit).

    .venv/bin/python bench/repro/replan.py bench/results/repro-full-f16-b32-r3.jsonl [--unit 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

PUSHDOWN_MARGIN = 0.10  # src/planner.rs
WITHIN = 1.05


def terms(split: str, prof: dict, stor: dict) -> dict:
    """One candidate's per-sample terms, as src/planner.rs reads them."""
    if split == "none":
        return {"storage": 0.0, "bytes": prof["raw_bytes_per_sample"], "compute": prof["compute_secs_per_sample"]["none"],
                "none": True}
    s = next(x for x in stor["splits"] if x["split"] == split)
    load = max(stor["load_factor"], 1.0) / max(stor["parallelism"], 1.0)
    return {"storage": s["secs_per_sample"] * load, "bytes": s["bytes_per_sample"],
            "compute": prof["compute_secs_per_sample"][split], "none": False}


def hapi(t: dict, prof: dict, _unit: int) -> float:
    """The gateway's model before ADR 0025: HAPI's per-iteration stream (storage, then transfer), overlapped
    with the compute tier's work on the previous iteration; deserialisation not overlapped."""
    b, bw = prof["batch_size"], prof["bandwidth_bytes_per_sec"]
    n = -(-prof["samples"] // b)
    decode = prof.get("decode_secs_per_byte") or 5e-10
    stream = b * t["storage"] + b * t["bytes"] / bw
    np_ = 0.0 if t["none"] else b * t["bytes"] * decode
    train = b * t["compute"] + prof["train_secs_per_batch"]
    return stream + (n - 1) * (max(stream, train) + np_) + np_ + train


def stages(t: dict, prof: dict, unit: int) -> float:
    """Three pipelined stages per request of `unit` samples (a shard): the storage node's
    compute, the link, the compute tier (deserialising included). The storage node computes
    request k+1 while request k crosses the link: the slowest stage sets the pace, the others
    add once (filling and draining the pipeline)."""
    b, bw = prof["batch_size"], prof["bandwidth_bytes_per_sec"]
    decode = prof.get("decode_secs_per_byte") or 5e-10
    storage = unit * t["storage"]
    link = unit * t["bytes"] / bw
    compute = unit * (t["compute"] + (0.0 if t["none"] else t["bytes"] * decode)) + prof["train_secs_per_batch"] * unit / b
    return storage + link + compute + max(prof["samples"] / unit - 1, 0) * max(storage, link, compute)


def with_start(model, none_extra: float):
    """`model` plus a start-up that only the baseline pays (the timelines: 1.1 s more for `none`)."""
    return lambda t, prof, unit: model(t, prof, unit) + (none_extra if t["none"] else 0.0)


MODELS = {"hapi (the gateway's before ADR 0025)": hapi, "stages (the gateway's since)": stages,
          "hapi + none start 1.1 s": with_start(hapi, 1.1), "stages + none start 1.1 s": with_start(stages, 1.1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+")
    ap.add_argument("--unit", type=int, default=64,
                    help="samples per request (the shard) for `stages`, where a profile does not record it")
    args = ap.parse_args()
    rows = [json.loads(line) for p in args.results for line in open(p) if line.strip()]
    groups = defaultdict(list)
    for r in rows:
        if not r.get("skipped") and r.get("overlap", True):
            groups[(r["model"], r["batch"], r["rate"])].append(r)
    score, total, ratios = defaultdict(int), 0, defaultdict(list)
    for (model, batch, rate), runs in sorted(groups.items()):
        measured = defaultdict(list)
        for r in runs:
            if r["mode"] == "images":
                measured["none"].append(r["epochs"][0])
            elif r["mode"].startswith("split:"):
                measured[r["mode"][6:]].append(r["epochs"][0])
        measured = {k: statistics.median(v) for k, v in measured.items()}
        auto = next((r for r in runs if r["mode"] == "auto" and r.get("plans") and "profile" in r["plans"][0]), None)
        if auto is None:
            continue
        plan = auto["plans"][0]
        prof, stor = plan["profile"], plan["storage"]
        recorded = {c["split"]: c["epoch_secs"] for c in plan["candidates"]}
        cands = [s for s, e in recorded.items() if e is not None and s in measured]
        unit = prof.get("samples_per_request") or args.unit
        gateway = stages if "samples_per_request" in prof else hapi
        drift = max(abs(gateway(terms(s, prof, stor), prof, unit) - recorded[s]) / recorded[s] for s in cands)
        assert drift < 1e-9, f"{model}@{rate}: the recomputed predictions differ from the recorded ones"
        best = min(measured.values())
        total += 1
        line = [f"{model} b{batch} {rate:>4} Mbit/s:"]
        for name, fn in MODELS.items():
            pred = {s: fn(terms(s, prof, stor), prof, unit) for s in cands}
            fastest = min(pred, key=pred.get)
            chosen = "none" if "none" in pred and pred[fastest] > (1 - PUSHDOWN_MARGIN) * pred["none"] else fastest
            q = measured[chosen] / best
            score[name] += q <= WITHIN
            ratios[name] += [pred[s] / measured[s] for s in cands]
            line.append(f"{name}: {chosen} {q:.2f}")
        print("  ".join(line))
    print(f"\nbest or within 5% of {total} configurations, and predicted / measured epoch over every option (median, 10th-90th percentile):")
    for name in MODELS:
        r = sorted(ratios[name])
        print(f"  {name}: {score[name]} of {total}; {statistics.median(r):.2f} ({r[len(r) // 10]:.2f}-{r[len(r) * 9 // 10]:.2f})")


if __name__ == "__main__":
    main()
