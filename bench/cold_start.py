"""What the first pushdown request of a fresh gateway pays beyond a warm one: for each model, a
new gateway alone on the last core (default config but the cache off, an fs backend holding one
shard of 64 synthetic 500x375 JPEGs) serves the shard's `pool` features once, then ROUNDS more
times, then once more after its engine was freed for being idle (`pushdown.engine_idle_secs`,
3 s here): the engine starts again, with what its first session measured and checked
(`tensorgate_pushdown_engine_starts_total{reason="remembered"}`). Reported per model: the first
request's seconds and the gateway's CPU seconds for it, the same for a warm request (median) and
for the request after the restart, and the engine's first-session phases from its debug log
(session, memory probes, prefix check, padding probe).

    .venv/bin/python bench/cold_start.py
    ROUNDS=5 BENCH_MODELS=resnet18 TENSORGATE_BIN=target/release/tensorgate ...

The reproduction's first shard arrives later than the steady pace of the others
(docs/REPRODUCTION.md); this says how much of that an engine's one-time work can be."""

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
sys.path.insert(0, str(ROOT / "bench"))
import conftest  # noqa: E402
import requests  # noqa: E402
from pinning import cpu_seconds, pin_gateway, pin_rest  # noqa: E402
from pushdown import jpeg_shard  # noqa: E402

from tensorgate import Client  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "3"))
MODELS = os.environ.get("BENCH_MODELS", "resnet50-thin,resnet18,pp-lcnet").split(",")
N = 64
PHASES = ("session_ms", "memory_ms", "check_ms", "padding_ms")
IDLE_SECS = 3
CONFIG = f"[pushdown]\nengine_idle_secs = {IDLE_SECS}\n[pushdown.cache]\nenabled = false\n"


def timed(client: Client, model: str, pid: int) -> tuple[float, float]:
    cpu, t = cpu_seconds(pid), time.perf_counter()
    got = client.get("cold", "s.tar", model, "pool")
    assert len(got.result.keys) == N, got
    return time.perf_counter() - t, cpu_seconds(pid) - cpu


def freed(admin: str) -> None:
    """Waits (at most 60 s) until the gateway holds no engine."""
    deadline = time.monotonic() + 60
    while requests.get(f"{admin}/v1/memory", timeout=10).json()["engines"]:
        assert time.monotonic() < deadline, "the idle engine was not freed"
        time.sleep(0.5)


def phases(log: Path) -> dict:
    """The first-session phases the engine logged (JSON or plain `key=value` lines)."""
    for line in log.read_text().splitlines():
        if "First session of an engine" not in line:
            continue
        try:
            fields = json.loads(line).get("fields", {})
        except ValueError:
            fields = dict(p.split("=", 1) for p in line.split() if "=" in p)
        return {k: int(str(fields[k]).strip('"')) for k in PHASES if k in fields}
    return {}


def main():
    body = jpeg_shard(N)
    pin_rest(os.getpid())
    print(f"one shard of {N} images at `pool`, a fresh gateway per model alone on the last core, "
          f"then {ROUNDS} warm requests\n")
    print("| model | first request s | its gateway CPU s | warm request s (median) | its CPU s | "
          "after a restart s | its CPU s | first session: session / memory / check / padding ms |")
    print("|---|---|---|---|---|---|---|---|")
    for model in MODELS:
        with tempfile.TemporaryDirectory() as tmp:
            env = {"TENSORGATE_LOG": "info,tensorgate::pushdown::engine=debug"}
            with conftest.run_gateway(Path(tmp), CONFIG, env=env) as (
                    endpoint, admin, s3, pid):
                pin_gateway(pid)
                s3.create_bucket(Bucket="cold")
                s3.put_object(Bucket="cold", Key="s.tar", Body=body)
                client = Client(endpoint, "tensorgate-dev", "tensorgate-dev-secret", admin=admin)
                first = timed(client, model, pid)
                warm = [timed(client, model, pid) for _ in range(ROUNDS)]
                freed(admin)
                restarted = timed(client, model, pid)
                starts = requests.get(f"{admin}/metrics", timeout=10).text
                assert 'tensorgate_pushdown_engine_starts_total{reason="remembered"} 1' in starts, starts
                log = next(Path(tmp).glob("gateway-*.log"))
                ph = phases(log)
            w = (statistics.median(s for s, _ in warm), statistics.median(c for _, c in warm))
            ms = " / ".join(str(ph.get(k, "-")) for k in PHASES)
            print(f"| {model} | {first[0]:.2f} | {first[1]:.2f} | {w[0]:.2f} | {w[1]:.2f} | "
                  f"{restarted[0]:.2f} | {restarted[1]:.2f} | {ms} |", flush=True)


if __name__ == "__main__":
    main()
