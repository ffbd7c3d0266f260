"""How much an ONNX Runtime CPU arena keeps, with the Python binding of the same library the
gateway loads (ADR 0011): one session, one thread, every batch size 1..16 once ascending (the
gateway's start-up sweep), then 60 runs at random batch sizes; resident bytes above the
pre-session size after each phase, and images/s at batch 1.

    GLIBC_TUNABLES=glibc.malloc.mmap_threshold=131072 taskset -c 1 .venv/bin/python bench/arena_retention.py

Settings: `off` (no arena: the gateway's default), `session` (a per-session arena without memory
patterns: `pushdown.ort_arena`; also warmed only at powers of two, or only at the largest batch,
instead of the sweep), `session+patterns` (what `ort_arena` did before its revision),
`env-same` (one environment arena, same-as-requested extension, shared by sessions: not
reachable from the gateway's `ort` crate without unsafe code), and the same with one run at the
largest batch before the sweep. Two more, tried as ways to keep the arena's speed without its
retention: `session, shrink` (the per-session arena, each run asking ONNX Runtime to give back the
arena's free regions at its end: run option `memory.enable_memory_arena_shrinkage`, which the
`ort` crate can set), `off, huge pages` (no arena, glibc asked to back its large mappings with
transparent huge pages: `glibc.malloc.hugetlb=1` added to the tunables; this script does not check
that glibc applied it, AnonHugePages in /proc/PID/smaps during a run would) and both together. Each setting runs in its
own process (an environment allocator and glibc's tunables are process-wide)."""

import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["resnet18", "resnet50-thin", "pp-lcnet"]
# SETTINGS="off;session, shrink" ... measures a subset.
SETTINGS = ["off", "off, huge pages", "session", "session, shrink", "session, shrink, huge pages", "session, powers of two",
            "session, largest first", "session+patterns", "env-same", "env-same, largest first"]
SETTINGS = [s for s in SETTINGS if s in os.environ.get("SETTINGS", ";".join(SETTINGS)).split(";")]
MAX_BATCH = 16


def resident() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def one(model: str, setting: str) -> str:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.enable_cpu_mem_arena = not setting.startswith("off")
    so.enable_mem_pattern = setting == "session+patterns"
    # "session, ...": the per-session arena with another warm-up order than the full sweep.
    if setting.startswith("env-same"):
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))  # kSameAsRequested
        so.add_session_config_entry("session.use_env_allocators", "1")
    path = str(ROOT / "models" / model / "model.onnx")
    probe = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    inp = probe.get_inputs()[0]
    shape = [d if isinstance(d, int) else 1 for d in inp.shape][1:]
    out = probe.get_outputs()[0].name
    rng = np.random.default_rng(0)
    inputs = {b: rng.random((b, *shape), dtype=np.float32) for b in range(1, MAX_BATCH + 1)}
    del probe
    base = resident()
    s = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])

    opts = ort.RunOptions()
    if setting.startswith("session, shrink"):
        opts.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def run(b):
        s.run([out], {inp.name: inputs[b]}, opts)

    if setting.endswith("largest first"):
        order = [MAX_BATCH]
    elif setting.endswith("powers of two"):
        order = [b for b in (1, 2, 4, 8, 16) if b <= MAX_BATCH]
    else:
        order = range(1, MAX_BATCH + 1)
    for b in order:
        run(b)
    swept = resident() - base
    random.seed(1)
    for _ in range(60):
        run(random.randint(1, MAX_BATCH))
    later = resident() - base
    rates = []
    for b, n in ((1, 40), (8, 5)):
        t = time.perf_counter()
        for _ in range(n):
            run(b)
        rates.append(b * n / (time.perf_counter() - t))
    return f"| {model} | {setting} | {swept >> 20} | {later >> 20} | {rates[0]:.1f} | {rates[1]:.1f} |"


def main() -> None:
    if len(sys.argv) == 3:
        print(one(sys.argv[1], sys.argv[2]))
        return
    print("| model | setting | MiB after the sweep | MiB after 60 random runs | images/s at batch 1 | at batch 8 |")
    print("|---|---|---|---|---|---|")
    for model in MODELS:
        for setting in SETTINGS:
            env = dict(os.environ)
            if setting.endswith("huge pages"):
                env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), "glibc.malloc.hugetlb=1") if t)
            r = subprocess.run([sys.executable, __file__, model, setting], capture_output=True, text=True, timeout=600,
                               env=env)
            print(r.stdout.strip() or f"| {model} | {setting} | failed: {r.stderr.strip()[-200:]} |")


if __name__ == "__main__":
    main()
