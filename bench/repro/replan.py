"""Re-decides the reproduction's recorded plans under other cost models, against what every option
measured in the same configuration (docs/REPRODUCTION.md, "How well `auto` chooses the split").

Each `auto` run records its first plan's inputs (the client profile and the gateway's storage
terms; `bench/repro/trainer.py` since the timelines). Each model below predicts every candidate's
epoch from exactly those inputs, picks as the gateway does (the argmin, `none` unless a split is
predicted `PUSHDOWN_MARGIN` faster), and the pick is scored against the measured first epochs of
the fixed options (`images`, `split:*`) of the same model, batch and rate: best or within 5% on the
medians over repeats; and, as a second score, missed only where every repeat of the pick is
more than 5% slower than every repeat of the best (a miss the measurement resolves). `auto`'s
own choices in every repeat are scored the same way.
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


MODELS = {"hapi (the gateway's before ADR 0025)": hapi, "stages (the gateway's since)": stages}


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
    score, clear, total, ratios = defaultdict(int), defaultdict(int), 0, defaultdict(list)
    as_run, spreads, end_to_end = [0, 0, 0], [], []
    for (model, batch, rate), runs in sorted(groups.items()):
        every = defaultdict(list)  # each option's first epochs, one per repeat
        for r in runs:
            if r["mode"] == "images":
                every["none"].append(r["epochs"][0])
            elif r["mode"].startswith("split:"):
                every[r["mode"][6:]].append(r["epochs"][0])
        measured = {k: statistics.median(v) for k, v in every.items()}
        spreads += [max(v) / min(v) - 1 for v in every.values() if len(v) > 1]
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
        best = min(measured, key=measured.get)
        total += 1

        def clear_miss(chosen: str) -> bool:
            """Slower than the best by more than 5% in every repeat of both: a miss the
            measurement resolves, not one inside its spread."""
            return min(every[chosen]) > WITHIN * max(every[best])

        line = [f"{model} b{batch} {rate:>4} Mbit/s:"]
        for name, fn in MODELS.items():
            pred = {s: fn(terms(s, prof, stor), prof, unit) for s in cands}
            fastest = min(pred, key=pred.get)
            chosen = "none" if "none" in pred and pred[fastest] > (1 - PUSHDOWN_MARGIN) * pred["none"] else fastest
            q = measured[chosen] / measured[best]
            score[name] += q <= WITHIN
            clear[name] += not clear_miss(chosen)
            ratios[name] += [pred[s] / measured[s] for s in cands]
            line.append(f"{name}: {chosen} {q:.2f}")
        # What `auto` chose in each of its runs (the model it ran with, at its measured inputs).
        picks = [r["plans"][0]["chosen"] for r in runs if r["mode"] == "auto" and r.get("plans")]
        picks = [p for p in picks if p in measured]
        as_run[0] += bool(picks)
        as_run[1] += bool(picks) and all(measured[p] / measured[best] <= WITHIN for p in picks)
        as_run[2] += bool(picks) and not any(clear_miss(p) for p in picks)
        # `auto`'s own first epochs (its profile and its first shard included) against the best.
        autos = [r["epochs"][0] for r in runs if r["mode"] == "auto"]
        if autos:
            end_to_end.append(statistics.median(autos) / measured[best])
        line.append(f"auto ran: {' '.join(picks)}; best {best}")
        print("  ".join(line))
    print(f"\n{total} configurations; best or within 5% (on the medians over repeats; and counting only misses "
          f"that every repeat resolves), and predicted / measured epoch over every option (median, 10th-90th "
          f"percentile):")
    for name in MODELS:
        r = sorted(ratios[name])
        print(f"  {name}: {score[name]} of {total}; {clear[name]} of {total}; "
              f"{statistics.median(r):.2f} ({r[len(r) // 10]:.2f}-{r[len(r) * 9 // 10]:.2f})")
    print(f"  `auto` as run, every repeat's choice: {as_run[1]} of {as_run[0]}; {as_run[2]} of {as_run[0]}")
    if end_to_end:
        end_to_end.sort()
        print(f"`auto`'s own first epoch / the best option's, medians over repeats: {end_to_end[0]:.2f}-"
              f"{end_to_end[-1]:.2f}, median {statistics.median(end_to_end):.2f}, "
              f"{sum(x >= 1.055 for x in end_to_end)} of {len(end_to_end)} at 1.06x or more")
    if spreads:
        spreads.sort()
        print(f"one option's first epochs across repeats, slowest / fastest - 1: median {statistics.median(spreads):.1%}, "
              f"90th percentile {spreads[len(spreads) * 9 // 10]:.1%}")


if __name__ == "__main__":
    main()
