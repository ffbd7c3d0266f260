"""How well the profiler's link probe (`Client.probe`) measures the shaped link: the repro's
topology (bench/repro/topology.sh: SeaweedFS + tensorgate in `tg-storage`, the client in
`tg-compute`), at each rate, each probe a fresh client process doing what `ShardLoader`'s profile
does first (the gateway's terms, the model list, then a GET of an images shard on a fresh
connection). That GET reads on to 8 MiB or 4 s and records every read, so that each stopping rule
of the probe is applied to the same timeline afterwards: the rule before 2026-12-05 and
`Client.probe`'s own; then `Client.probe` itself runs on the warm connection.

    sudo .venv/bin/python bench/repro/probe.py [--rates 10 25 50] [--repeats 4]

Results: one JSON line per probe in `bench/results/repro-probe.jsonl`; a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run  # noqa: E402  (the repro's tiers and dataset)

sys.path.insert(0, str(run.ROOT / "clients" / "python"))
from tensorgate import client as probe  # noqa: E402  (the probe's rules)

ROOT = run.ROOT

#: The compute tier's side: a fresh process, as a trainer is.
PROBE = r"""
import json, sys, time
from tensorgate import Client
from tensorgate import client as client_mod
c = Client(sys.argv[1], sys.argv[2], sys.argv[3], admin=sys.argv[4])
c.storage("resnet50-thin"); c.models()
# The profile's first S3 request (a fresh connection), read on past where the probe stops.
resp = c.s3.get_object(Bucket="repro", Key="images/00000.tar", Range=f"bytes=0-{(8 << 20) - 1}")
body, reads, n, t0 = resp["Body"], [], 0, time.perf_counter()
while n < 8 << 20 and time.perf_counter() - t0 < 4:
    a = time.perf_counter(); d = body.read(16 << 10)
    if not d: break
    reads.append((a - t0, time.perf_counter() - t0, n, n + len(d))); n += len(d)
body.close()
head, rate = c.probe("repro", "images/00001.tar")  # the probe itself, on the warm connection
print(json.dumps({"probe": rate, "probe_bytes": len(head), "reads": reads}))
"""


def sustained(reads: list, after: float) -> float:
    """Bytes/s over the reads that started `after` seconds or later into the transfer."""
    tail = [r for r in reads if r[0] >= after]
    return (tail[-1][3] - tail[0][2]) / (tail[-1][1] - tail[0][0]) if len(tail) > 1 else float("nan")


def stop_at(reads: list, settled) -> list:
    """The reads a probe with stopping rule `settled` would have made of this transfer."""
    return next((reads[: i + 1] for i in range(len(reads)) if settled(reads[: i + 1])), reads)


def before(reads: list) -> float:
    """The probe before 2026-12-05: at least 128 KiB and 0.15 s from its first read, the rate from
    the first read that waited."""
    window = stop_at(reads, lambda rs: rs[-1][3] >= 128 << 10 and rs[-1][1] >= 0.15)
    return probe.link_probe_rate(window), window[-1][1]


def now(reads: list) -> float:
    """`Client.probe`'s own rule (clients/python/tensorgate/client.py)."""
    window = stop_at(reads, lambda rs: probe.probe_settled(rs, 128 << 10, probe.PROBE_MIN_SECS, probe.PROBE_MAX_SECS))
    return probe.link_probe_rate(window), window[-1][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", nargs="+", type=int, default=[10, 25, 50, 100, 250, 1000])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "repro-probe.jsonl")
    args = ap.parse_args()
    cfg = dict(run.MODES["quick"], images=128, models=["resnet50-thin"])
    workdir = Path(tempfile.mkdtemp(prefix="repro-probe-"))
    objects = {k: v for k, v in run.make_data(cfg, workdir).items() if k.startswith("images/")}
    subprocess.run([str(run.TOPOLOGY), "up", str(args.rates[0])], check=True)
    tiers, rows = None, []
    try:
        tiers = run.Tiers(True, workdir, cache=False)
        tiers.start()
        tiers.upload(objects)
        for rate in args.rates:
            run.shape(rate)
            measured = subprocess.run([str(run.TOPOLOGY), "measure"], capture_output=True, text=True).stdout.strip()
            for repeat in range(args.repeats):
                time.sleep(1)  # an idle link, as before a trainer's first request
                argv = [sys.executable, "-c", PROBE, tiers.endpoint, run.KEY, run.SECRET, tiers.admin]
                out = subprocess.run(tiers.compute_cmd(argv), capture_output=True, text=True, timeout=120,
                                     env={"PYTHONPATH": str(ROOT / "clients" / "python"), "PATH": "/usr/bin:/bin"})
                if out.returncode:
                    sys.exit(out.stderr)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(dict(rate=rate, repeat=repeat, measure=measured, **r))
    finally:
        if tiers:
            tiers.stop()
        subprocess.run([str(run.TOPOLOGY), "down"], check=False)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print("Each probe's estimate over the shaped rate (`topology.sh`'s tbf rate x 0.958, the ratio its "
          "`measure` reports at 10 Mbit/s), min-max over the repeats; seconds the probe read (median):\n")
    print("| Mbit/s | shaped MB/s | rule before | its seconds | `Client.probe`'s rule | its seconds | "
          "`Client.probe` itself (warm connection) | one connection's rate after 1 s |")
    print("|---|---|---|---|---|---|---|---|")
    for rate in args.rates:
        rs = [r for r in rows if r["rate"] == rate]
        shaped = rate / 8 * 0.958e6

        def span(est):
            return f"{min(e[0] for e in est) / shaped:.2f}-{max(e[0] for e in est) / shaped:.2f}"

        old, new = [before(r["reads"]) for r in rs], [now(r["reads"]) for r in rs]
        live = [r["probe"] / shaped for r in rs]
        print(f"| {rate} | {shaped / 1e6:.2f} | {span(old)} | {statistics.median(e[1] for e in old):.2f} | "
              f"{span(new)} | {statistics.median(e[1] for e in new):.2f} | {min(live):.2f}-{max(live):.2f} | "
              f"{statistics.median(sustained(r['reads'], 1.0) for r in rs) / shaped:.2f} |")


if __name__ == "__main__":
    main()
