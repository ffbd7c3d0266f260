"""Turns bench/passthrough.sh's JSON lines into a markdown report: medians over rounds, the gateway's
ratios to direct and (when measured) to nginx, and CPU seconds per GB moved for each process.
A second file (s3bench's LATENCY_OUT lines) adds the sequential GETs' latencies pooled over rounds."""

import json
import statistics
import sys
from collections import defaultdict

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
labels = [x for x in ("direct", "gateway", "nginx") if any(r["label"] == x for r in rows)]
anchor = "nginx" in labels
tp = defaultdict(lambda: defaultdict(list))
lat = defaultdict(lambda: defaultdict(list))
moved = defaultdict(int)  # bytes one workload run moves (per label, from the first round's rows)
for r in rows:
    if r["test"] == "throughput":
        for k in ("put_mb_s", "get_mb_s"):
            tp[(r["size"], r["concurrency"], k)][r["label"]].append(r[k])
    elif r["test"] == "latency":
        for k in ("p50_ms", "p99_ms"):
            lat[(r["concurrency"], k)][r["label"]].append(r[k])


def size(n):
    return f"{n // 1024} KiB" if n < 1024 * 1024 else f"{n // (1024 * 1024)} MiB"


def med(v, label):
    return statistics.median(v[label])


head = "| object | op | concurrency | direct MB/s | gateway MB/s | gateway / direct |"
print(head + (" nginx MB/s | gateway / nginx |" if anchor else ""))
print("|---|---|---|---|---|---|" + ("---|---|" if anchor else ""))
for (sz, conc, k), v in sorted(tp.items()):
    d, g = med(v, "direct"), med(v, "gateway")
    line = f"| {size(sz)} | {k[:3].upper()} | {conc} | {d:.1f} | {g:.1f} | {g / d:.2f} |"
    if anchor:
        n = med(v, "nginx")
        line += f" {n:.1f} | {g / n:.2f} |"
    print(line)
print()
print("| 4 KiB GET latency | concurrency | direct ms | gateway ms | added ms |" + (" nginx ms | nginx added ms |" if anchor else ""))
print("|---|---|---|---|---|" + ("---|---|" if anchor else ""))
for (conc, k), v in sorted(lat.items()):
    d, g = med(v, "direct"), med(v, "gateway")
    line = f"| {k.split('_')[0]} | {conc} | {d:.3f} | {g:.3f} | {g - d:+.3f} |"
    if anchor:
        n = med(v, "nginx")
        line += f" {n:.3f} | {n - d:+.3f} |"
    print(line)
print()

# The sequential GETs of every round pooled: a tail of a few hundred requests, not of one round's
# ten, and the share slower than direct's pooled p99 (what the proxy's hop adds to the tail).
pooled = defaultdict(list)
if len(sys.argv) > 2:
    for line in open(sys.argv[2]):
        if line.strip():
            r = json.loads(line)
            if r["concurrency"] == 1:
                pooled[r["label"]] += r["ms"]
if "direct" in pooled:
    def q(v, p):
        return v[round((len(v) - 1) * p)]

    ref = q(sorted(pooled["direct"]), 0.99)
    print("| sequential 4 KiB GETs, all rounds | requests | p50 ms | p90 ms | p99 ms | p99.9 ms |"
          f" slower than direct's p99 ({ref:.3f} ms) |")
    print("|---|---|---|---|---|---|---|")
    for label in labels:
        v = sorted(pooled[label])
        over = sum(x > ref for x in v) / len(v)
        print(f"| {label} | {len(v)} | {q(v, .5):.3f} | {q(v, .9):.3f} | {q(v, .99):.3f} | {q(v, .999):.3f} | {over:.1%} |")
    print()

# Bytes of one full workload run: every PUT and GET of the throughput rows, the latency GETs.
rounds = max(1, sum(r["test"] == "cpu" and r["label"] == "direct" for r in rows))
for r in rows:
    if r["test"] == "throughput":
        moved[r["label"]] += 2 * r["size"] * r["count"]
    elif r["test"] == "latency":
        moved[r["label"]] += r["size"] * r["count"]
cpu = defaultdict(lambda: defaultdict(list))
for r in rows:
    if r["test"] == "cpu":
        cpu[r["label"]]["client_cpu_s"].append(r["client_cpu_s"])
        cpu[r["label"]]["store_cpu_s"].append(r["store_cpu_s"])
        # `gateway_cpu_s`: raw lines written before the nginx anchor
        cpu[r["label"]]["proxy_cpu_s"].append(r.get("proxy_cpu_s", r.get("gateway_cpu_s", 0.0)))
if cpu:
    gb = moved["direct"] / rounds / 1e9
    print(f"One workload run moves {gb:.2f} GB. CPU seconds per GB moved (median over rounds):")
    print()
    print("| path | client | SeaweedFS | proxy (gateway or nginx) |")
    print("|---|---|---|---|")
    for label in labels:
        c = cpu[label]
        print(f"| {label} | {statistics.median(c['client_cpu_s']) / gb:.2f} | "
              f"{statistics.median(c['store_cpu_s']) / gb:.2f} | {statistics.median(c['proxy_cpu_s']) / gb:.2f} |")
    if anchor:
        g, n = statistics.median(cpu["gateway"]["proxy_cpu_s"]), statistics.median(cpu["nginx"]["proxy_cpu_s"])
        print()
        print(f"Gateway CPU per GB / nginx CPU per GB: {g / n:.2f} (the gateway also verifies SigV4 and re-signs).")
    print()
# Per row: each PUT and GET phase's proxy and store CPU over the bytes it moved (s3bench's
# CPU_PIDS fields). The node's CPU (proxy + store) matters too: what one proxy checks, the store
# may not have to (signed aws-chunked uploads reach the store through the gateway already verified).
phase = defaultdict(lambda: defaultdict(list))
for r in rows:
    if r["test"] == "throughput":
        gb_row = r["size"] * r["count"] / 1e9
        for op in ("put", "get"):
            if f"{op}_store_cpu_s" in r:
                proxy = r.get(f"{op}_proxy_cpu_s", 0.0) / gb_row
                phase[(r["size"], op)][r["label"]].append((proxy, proxy + r[f"{op}_store_cpu_s"] / gb_row))
if phase:
    print("CPU seconds per GB for each row, median over rounds: the proxy alone, and the node (proxy +")
    print("SeaweedFS). CPU ticks are 10 ms, so the 4 KiB rows, which move 6 MB each, are coarse.")
    print()
    print("| object | op | gateway s/GB |" + (" nginx s/GB | gateway / nginx | node: gateway / nginx |" if anchor else ""))
    print("|---|---|---|" + ("---|---|---|" if anchor else ""))
    for (sz, op), v in sorted(phase.items()):
        g = statistics.median(x[0] for x in v["gateway"])
        line = f"| {size(sz)} | {op.upper()} | {g:.2f} |"
        if anchor and v["nginx"]:
            n = statistics.median(x[0] for x in v["nginx"])
            gn = statistics.median(x[1] for x in v["gateway"]) / statistics.median(x[1] for x in v["nginx"])
            line += f" {n:.2f} | {g / n:.2f} | {gn:.2f} |" if n else f" {n:.2f} | - | {gn:.2f} |"
        print(line)
    print()
for r in rows:
    if r["test"] == "big":
        cpu_note = ""
        if "put_proxy_cpu_s" in r:
            gib = r["bytes"] / 1e9
            cpu_note = f"; gateway CPU {r['put_proxy_cpu_s'] / gib:.2f} s/GB PUT, {r['get_proxy_cpu_s'] / gib:.2f} s/GB GET"
        print(f"1 GiB through the gateway: PUT {r['put_s']:.1f} s, GET {r['get_s']:.1f} s ({r['bytes']} bytes read back{cpu_note}).")
    if r["test"] == "rss":
        print(f"Gateway peak RSS (VmHWM): {r['hwm_before_kib'] / 1024:.1f} MiB before the 1 GiB transfers, {r['hwm_after_kib'] / 1024:.1f} MiB after.")
