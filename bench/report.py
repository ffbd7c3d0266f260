"""Turns bench/passthrough.sh's JSON lines into a markdown report (medians over rounds, ratios)."""

import json
import statistics
import sys
from collections import defaultdict

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
tp = defaultdict(lambda: defaultdict(list))
lat = defaultdict(lambda: defaultdict(list))
for r in rows:
    if r["test"] == "throughput":
        for k in ("put_mb_s", "get_mb_s"):
            tp[(r["size"], r["concurrency"], k)][r["label"]].append(r[k])
    elif r["test"] == "latency":
        for k in ("p50_ms", "p99_ms"):
            lat[(r["concurrency"], k)][r["label"]].append(r[k])

def size(n):
    return f"{n // 1024} KiB" if n < 1024 * 1024 else f"{n // (1024 * 1024)} MiB"

print("| object | op | concurrency | direct MB/s | gateway MB/s | gateway / direct |")
print("|---|---|---|---|---|---|")
for (sz, conc, k), v in sorted(tp.items()):
    d, g = statistics.median(v["direct"]), statistics.median(v["gateway"])
    print(f"| {size(sz)} | {k[:3].upper()} | {conc} | {d:.1f} | {g:.1f} | {g / d:.2f} |")
print()
print("| 4 KiB GET latency | concurrency | direct ms | gateway ms | added ms |")
print("|---|---|---|---|---|")
for (conc, k), v in sorted(lat.items()):
    d, g = statistics.median(v["direct"]), statistics.median(v["gateway"])
    print(f"| {k.split('_')[0]} | {conc} | {d:.3f} | {g:.3f} | {g - d:+.3f} |")
print()
cpu = defaultdict(lambda: defaultdict(list))
for r in rows:
    if r["test"] == "cpu":
        for k in ("client_cpu_s", "store_cpu_s", "gateway_cpu_s"):
            cpu[r["label"]][k].append(r[k])
if cpu:
    print("| CPU seconds per full workload run (median) | client | SeaweedFS | gateway |")
    print("|---|---|---|---|")
    for label in ("direct", "gateway"):
        c = cpu[label]
        print(f"| {label} | {statistics.median(c['client_cpu_s']):.1f} | {statistics.median(c['store_cpu_s']):.1f} | {statistics.median(c['gateway_cpu_s']):.1f} |")
    print()
for r in rows:
    if r["test"] == "big":
        print(f"1 GiB through the gateway: PUT {r['put_s']:.1f} s, GET {r['get_s']:.1f} s ({r['bytes']} bytes read back).")
    if r["test"] == "rss":
        print(f"Gateway peak RSS (VmHWM): {r['hwm_before_kib'] / 1024:.1f} MiB before the 1 GiB transfers, {r['hwm_after_kib'] / 1024:.1f} MiB after.")
