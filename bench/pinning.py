"""The pinned method of the benchmarks (docs/BENCHMARKS.md, "How the benchmarks are pinned"): the
gateway alone on the last core, the store and the client on the others, so a ratio shows what the
gateway costs with a core of its own (as on a storage node) instead of how much of the others'
share it takes; and each process's CPU seconds, read from /proc, so work per image or per GB is
reported next to throughput. PIN=0 leaves everything unpinned."""

import os
from pathlib import Path

LAST = os.cpu_count() - 1
PIN = os.environ.get("PIN", "1") == "1" and LAST >= 1
ALL_CPUS = os.sched_getaffinity(0)
GATEWAY_CPUS = {LAST} if PIN else ALL_CPUS
REST_CPUS = ALL_CPUS - {LAST} if PIN else ALL_CPUS
TICK = os.sysconf("SC_CLK_TCK")


def pin(pid: int, cpus: set[int]) -> None:
    """Moves every thread of `pid` to `cpus`; threads it starts later inherit that."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, PermissionError):
            pass


def pin_gateway(pid: int) -> None:
    pin(pid, GATEWAY_CPUS)


def pin_rest(*pids: int) -> None:
    """The store's processes and this one (the client)."""
    for pid in pids:
        pin(pid, REST_CPUS)
    os.sched_setaffinity(0, REST_CPUS)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` so far (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def describe() -> str:
    return (f"pinned: gateway on CPU {LAST}, store and client on CPUs {sorted(REST_CPUS)}" if PIN
            else "unpinned (PIN=0)")
