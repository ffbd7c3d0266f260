"""HAPI's experiments under emulated bandwidth: a storage namespace (SeaweedFS +
tensorgate, pinned to CPU 0) and a compute namespace (the trainer, pinned to CPU 1) joined by a
veth pair shaped with tc tbf (bench/repro/topology.sh), swept over rates, models and modes.

    sudo .venv/bin/python bench/repro/run.py --mode quick     # <= 10 minutes
    sudo .venv/bin/python bench/repro/run.py --mode full      # <= 2 hours
    .venv/bin/python bench/repro/run.py --mode smoke          # CI: loopback, tiny data, no namespaces

`TENSORGATE_BIN` names the gateway binary (default: target/release/tensorgate).

Every run appends a JSON line to `bench/results/repro-<mode>.jsonl` (median over repeats is taken
by bench/repro/report.py, which writes docs/REPRODUCTION.md and its plots). The topology is always
torn down, even on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "clients" / "python"))
import dataset  # noqa: E402
from trainer import AUGMENT_SEED  # noqa: E402

TOPOLOGY = ROOT / "bench" / "repro" / "topology.sh"
S_IP = "10.77.0.1"
SEAWEED_PORT = 18833
KEY, SECRET = "repro", "repro-secret"

MODES = {
    # name: images, per shard, models, rates (Mbit/s; None = unshaped loopback), repeats, epochs,
    # overlap-off ablation rates, cache run (epochs at 25 Mbit/s), per-run time limit (s): a run past
    # it is recorded as a timeout (its epoch time is at least the limit; early splits at 10 Mbit/s
    # would otherwise take many minutes each)
    "smoke": dict(images=64, per_shard=32, models=["tiny-cnn"], rates=[None], repeats=1, batch=32, ablation=[None],
                  cache_epochs=0, limit=120),
    "quick": dict(images=128, per_shard=64, models=["resnet50-thin"], rates=[10, 100, 1000], repeats=1, batch=64,
                  ablation=[25], cache_epochs=5, limit=30),
    # The other two models at the quick settings (no ablation or cache runs): about 3 minutes.
    "quick-more": dict(images=128, per_shard=64, models=["resnet18", "pp-lcnet"], rates=[10, 100, 1000], repeats=1,
                       batch=64, ablation=[], cache_epochs=0, limit=30),
    # The overlap ablation where both sides matter: a training step (emulated accelerator time,
    # 0.5 s per batch of 64) comparable to a batch's transfer at 25 Mbit/s (6.7 MB: 2.2 s) and to
    # the storage node's compute for it (about 1.5 s at pool).
    "overlap": dict(images=512, per_shard=64, models=["resnet50-thin"], rates=[], repeats=1, batch=64,
                    ablation=[25], cache_epochs=0, limit=120, train_secs=0.5),
    # Every model and rate, 3 repeats; the overlap ablation with the 0.5 s training step at 25 and
    # 100 Mbit/s; the 5-epoch cache run. Runs that provably lose (below) are not run.
    "full": dict(images=256, per_shard=64, models=["resnet18", "resnet50-thin", "pp-lcnet"], rates=[10, 25, 50, 100, 250, 1000],
                 repeats=3, batch=64, ablation=[25, 100], ablation_train_secs=0.5, cache_epochs=5, limit=60),
    # One configuration of the full mode again (every option, 3 repeats): a fresh measurement
    # after a planner change. `--models` / `--rates` pick it (default: the full run's one miss).
    # Augmented epochs (ADR 0032): 5 epochs of ResNet-50-thin at 10 Mbit/s with torchvision's
    # RandomResizedCrop + RandomHorizontalFlip drawn anew each epoch, the raw JPEGs augmented and
    # run here against the gateway augmenting and running the prefix; the same pushdown over
    # the unshaped link (1000 Mbit/s) is the storage core's bound for what it must still compute.
    "augment": dict(images=256, per_shard=64, models=["resnet50-thin"], rates=[], repeats=1, batch=64, ablation=[],
                    cache_epochs=0, augment_epochs=5, limit=60),
    "recheck": dict(images=256, per_shard=64, models=["resnet18"], rates=[1000], repeats=3, batch=64, ablation=[],
                    cache_epochs=0, limit=60),
}

#: A fixed-split or tensors run is skipped when the bytes it must move, at the link's rate, already
#: take this much longer than the fastest option run so far for the same (model, rate, repeat):
#: it cannot be the best or within 5% of it, and at 10 Mbit/s an early split would take minutes.
#: Its row records that lower bound (`skipped`).
SKIP_MARGIN = 1.10


def manifest(model: str) -> dict:
    return tomllib.loads((ROOT / "models" / model / "manifest.toml").read_text())


def splits_to_freeze(model: str) -> list[str]:
    m = manifest(model)
    names = [s["name"] for s in m["splits"]]
    return names[: names.index(m["freeze"]) + 1]


def transfer_bound(rate, epoch_bytes: float) -> float | None:
    """Seconds `epoch_bytes` need on a link of `rate` Mbit/s at least (None: unshaped)."""
    return None if rate is None else epoch_bytes * 8 / (rate * 1e6)


def model_info(model: str) -> dict:
    m = manifest(model)
    p = dict(m["preprocess"])
    p["channels"] = p.get("channels", "RGB").lower()
    return {"preprocess": p, "layout": m["layout"]}


def make_data(cfg: dict, workdir: Path) -> dict[str, bytes]:
    """Image shards and, per model, the same samples as pre-transformed tensor shards."""
    from tensorgate.suffix import preprocess

    items = dataset.samples(cfg["images"])
    objects = {f"images/{i:05d}.tar": s for i, s in enumerate(dataset.image_shards(items, cfg["per_shard"]))}
    for model in cfg["models"]:
        info = model_info(model)
        shards = dataset.tensor_shards(items, cfg["per_shard"], lambda jpg: preprocess(jpg, info))
        objects.update({f"tensors/{model}/{i:05d}.tar": s for i, s in enumerate(shards)})
    return objects


class Tiers:
    """Starts SeaweedFS and the gateway (storage tier) and runs trainers (compute tier), in
    namespaces or, for the smoke mode, on loopback."""

    def __init__(self, namespaces: bool, workdir: Path, cache: bool, dtype: str | None = None):
        self.ns, self.workdir, self.cache, self.dtype = namespaces, workdir, cache, dtype
        self.host = S_IP if namespaces else "127.0.0.1"
        self.procs: list[subprocess.Popen] = []

    def storage_cmd(self, argv: list[str]) -> list[str]:
        return (["ip", "netns", "exec", "tg-storage", "taskset", "-c", "0"] if self.ns else []) + argv

    def compute_cmd(self, argv: list[str]) -> list[str]:
        return (["ip", "netns", "exec", "tg-compute", "taskset", "-c", "1"] if self.ns else []) + argv

    def start(self) -> None:
        env = dict(os.environ, SEAWEED_PORT=str(SEAWEED_PORT))
        out = subprocess.run(self.storage_cmd([str(ROOT / "scripts/seaweedfs.sh"), "start"]), env=env, check=True,
                             capture_output=True, text=True)
        self.seaweed = out.stdout.strip()
        self.start_gateway()

    def restart_gateway(self, cache: bool) -> None:
        """A fresh gateway over the same store (the dataset stays)."""
        self.gateway.terminate()
        self.gateway.wait(timeout=30)
        self.procs.remove(self.gateway)
        self.cache = cache
        self.start_gateway()

    def start_gateway(self) -> None:
        import onnxruntime

        lib = next((Path(onnxruntime.__file__).parent / "capi").glob("libonnxruntime.so*"))
        port, admin = (9000, 9001) if self.ns else (free_port(), free_port())
        self.endpoint, self.admin = f"http://{self.host}:{port}", f"http://{self.host}:{admin}"
        cfg = self.workdir / f"gateway-{port}.toml"
        cfg.write_text(f'[[credentials]]\naccess_key = "{KEY}"\nsecret_key = "{SECRET}"\n'
                       # 8 GiB: a sweep keeps an engine (sessions and activations) for every split of
                       # three models alive in one gateway; the default 1 GiB is sized for a node
                       # serving a few splits, and the last engines of the sweep would not fit.
                       f"[pushdown]\nworkers = 1\nmax_batch = 16\nqueue_capacity = 1024\nmemory_budget = 8589934592\n"
                       # RUNS=N: `pushdown.inference_runs` (the comparison with engines unordered).
                       + (f"inference_runs = {int(os.environ['RUNS'])}\n" if os.environ.get("RUNS") else "")
                       + f"[pushdown.cache]\nenabled = {'true' if self.cache else 'false'}\nmemory_bytes = 2147483648\n")
        genv = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
        genv.update(TENSORGATE_CONFIG=str(cfg), TENSORGATE_LISTEN=f"{self.host}:{port}",
                    TENSORGATE_ADMIN_LISTEN=f"{self.host}:{admin}", TENSORGATE_BACKEND_ENDPOINT=self.seaweed,
                    TENSORGATE_BACKEND_ACCESS_KEY="seaweed-ak", TENSORGATE_BACKEND_SECRET_KEY="seaweed-sk",
                    TENSORGATE_MODELS_DIR=str(ROOT / "models"), TENSORGATE_ORT_LIBRARY=str(lib),
                    # REPRO_GATEWAY_LOG=tensorgate::pushdown=debug: when each request's samples start and end.
                    TENSORGATE_LOG=os.environ.get("REPRO_GATEWAY_LOG", "warn"))
        log = open(self.workdir / f"gateway-{port}.log", "w")
        binary = os.environ.get("TENSORGATE_BIN") or str(ROOT / "target/release/tensorgate")
        self.gateway = subprocess.Popen(self.storage_cmd([binary, "serve"]), env=genv,
                                        stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(self.gateway)
        self.in_storage([sys.executable, "-c", WAIT_READY, self.admin])

    def in_storage(self, argv: list[str], stdin: bytes | None = None) -> bytes:
        return subprocess.run(self.storage_cmd(argv), input=stdin, check=True, capture_output=True).stdout

    def upload(self, objects: dict[str, bytes]) -> None:
        """Writes the dataset straight into SeaweedFS, inside the storage tier (not over the link)."""
        self.in_storage([sys.executable, "-c", UPLOAD, self.seaweed], stdin=dataset.tar_of(objects.items()))

    def gateway_pid(self) -> int:
        """The gateway process (a child of `ip netns exec` / taskset, which exec it)."""
        return self.gateway.pid

    def usage(self) -> tuple[float, int]:
        """Storage-side CPU seconds so far and peak RSS (bytes) of the gateway."""
        pid = self.gateway_pid()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        hwm = next(int(l.split()[1]) * 1024 for l in Path(f"/proc/{pid}/status").read_text().splitlines() if l.startswith("VmHWM"))
        return cpu, hwm

    def reset_peak(self) -> None:
        Path(f"/proc/{self.gateway_pid()}/clear_refs").write_text("5")

    def train(self, model: str, mode: str, batch: int, epochs: int, overlap: bool, limit: float,
              train_secs: float = 0.0) -> dict:
        argv = [sys.executable, str(ROOT / "bench/repro/trainer.py"), "--endpoint", self.endpoint, "--admin", self.admin,
                "--access-key", KEY, "--secret-key", SECRET, "--model", model, "--mode", mode,
                "--batch-size", str(batch), "--epochs", str(epochs), "--overlap", str(int(overlap)),
                "--train-secs", str(train_secs), *(["--dtype", self.dtype] if self.dtype else [])]
        try:
            out = subprocess.run(self.compute_cmd(argv), capture_output=True, text=True, timeout=limit * epochs)
            if out.returncode != 0:  # recorded (the report lists it), and the sweep goes on
                why = (out.stderr.strip().splitlines() or ["no output"])[-1]
                print(f"trainer {mode} failed: {out.stderr[-2000:]}", file=sys.stderr, flush=True)
                return {"epochs": [limit] * epochs, "bytes": None, "split": mode.split(":")[-1], "failed": why}
        except subprocess.TimeoutExpired:
            return {"epochs": [limit] * epochs, "bytes": None, "split": mode.split(":")[-1], "timeout": True}
        return json.loads(out.stdout.strip().splitlines()[-1])

    def split_bytes(self, model: str) -> dict[str, float]:
        """Output bytes per sample of each candidate split (of the run's dtype), as the gateway
        reports them."""
        query = f"{model}&dtype={self.dtype}" if self.dtype else model
        code = ("import json, sys, urllib.request; "
                "print(urllib.request.urlopen(sys.argv[1] + '/v1/storage?model=' + sys.argv[2]).read().decode())")
        out = json.loads(self.in_storage([sys.executable, "-c", code, self.admin, query]))
        return {s["split"]: s["bytes_per_sample"] for s in out["splits"]}

    def prefetch_graphs(self, models: list[str]) -> None:
        """Puts every suffix graph in the client's disk cache (setup: the compute tier holds its
        model), so that no timed run downloads one."""
        code = ("import sys; from tensorgate import Client; from tensorgate.suffix import prefetch_graphs; "
                "c = Client(sys.argv[1], sys.argv[2], sys.argv[3], admin=sys.argv[4]); "
                "[prefetch_graphs(c, m) for m in sys.argv[5:]]")
        subprocess.run(self.compute_cmd([sys.executable, "-c", code, self.endpoint, KEY, SECRET, self.admin, *models]),
                       check=True, capture_output=True, timeout=1800)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        env = dict(os.environ, SEAWEED_PORT=str(SEAWEED_PORT))
        subprocess.run(self.storage_cmd([str(ROOT / "scripts/seaweedfs.sh"), "stop"]), env=env, check=False, capture_output=True)


WAIT_READY = """
import sys, time, urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(sys.argv[1] + "/readyz", timeout=1); sys.exit(0)
    except OSError:
        time.sleep(0.1)
sys.exit("gateway not ready")
"""

UPLOAD = """
import io, sys, tarfile, boto3
s3 = boto3.client("s3", endpoint_url=sys.argv[1], aws_access_key_id="seaweed-ak", aws_secret_access_key="seaweed-sk", region_name="us-east-1")
try:
    s3.create_bucket(Bucket="repro")
except Exception:
    pass
with tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read())) as tar:
    for m in tar:
        s3.put_object(Bucket="repro", Key=m.name, Body=tar.extractfile(m).read())
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shape(rate) -> None:
    if rate is not None:
        subprocess.run([str(TOPOLOGY), "rate", str(rate)], check=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=sorted(MODES), default="quick")
    ap.add_argument("--out", type=Path, default=None, help="results JSONL (default bench/results/repro-MODE.jsonl)")
    ap.add_argument("--models", nargs="+", help="override the mode's models")
    ap.add_argument("--rates", nargs="+", type=int, help="override the mode's rates (Mbit/s)")
    ap.add_argument("--batch", type=int, help="override the mode's training batch size (the planner's B)")
    ap.add_argument("--repeats", type=int, help="override the mode's repeats per configuration (medians over them)")
    ap.add_argument("--splits-only", action="store_true",
                    help="only the first-epoch sweep (splits, baselines, auto): no overlap ablation, no cache run "
                         "(another batch size's configurations for the planner's choice quality)")
    ap.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="f32",
                    help="features' element type on the wire for pushdown runs (the baselines move raw bytes)")
    args = ap.parse_args(argv)
    # SIGTERM (a stopped run) unwinds through the finally below: servers stopped, topology removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    cfg = dict(MODES[args.mode], **({"models": args.models} if args.models else {}),
               **({"rates": args.rates} if args.rates else {}), **({"batch": args.batch} if args.batch else {}),
               **({"repeats": args.repeats} if args.repeats else {}),
               **({"ablation": [], "cache_epochs": 0} if args.splits_only else {}))
    namespaces = args.mode != "smoke"
    suffix = ("" if args.dtype == "f32" else f"-{args.dtype}") + (f"-b{args.batch}" if args.batch else "")
    out = args.out or ROOT / "bench" / "results" / f"repro-{args.mode}{suffix}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    workdir = Path(tempfile.mkdtemp(prefix="repro-"))
    objects = make_data(cfg, workdir)
    jpeg_bytes = sum(len(v) for k, v in objects.items() if k.startswith("images/"))
    if namespaces:
        subprocess.run([str(TOPOLOGY), "up", str((cfg["rates"] or cfg["ablation"] or [10])[0])], check=True)
    tiers = None
    started = time.time()
    try:
        tiers = Tiers(namespaces, workdir, cache=False, dtype=None if args.dtype == "f32" else args.dtype)
        tiers.start()
        tiers.upload(objects)
        shape(1000 if namespaces else None)
        tiers.prefetch_graphs(cfg["models"])

        tensor_bytes = {m: sum(len(v) for k, v in objects.items() if k.startswith(f"tensors/{m}/")) for m in cfg["models"]}
        split_bytes = {m: tiers.split_bytes(m) for m in cfg["models"]}

        def bound(model, rate, mode, epochs):
            if mode == "tensors":
                return transfer_bound(rate, tensor_bytes[model] * epochs)
            if mode.endswith(("+local", "+augment")):
                return None
            if mode.startswith("split:"):
                return transfer_bound(rate, split_bytes[model][mode[6:]] * cfg["images"] * epochs)
            return None

        def record(model, rate, mode, overlap, epochs, repeat, tiers=tiers, extra=None, best=None, train_secs=None):
            """Runs one point (or records its lower bound when `best` shows it cannot win); returns
            its total seconds."""
            train_secs = cfg.get("train_secs", 0.0) if train_secs is None else train_secs
            lower = bound(model, rate, mode, epochs)
            if best is not None and lower is not None and lower > SKIP_MARGIN * best:
                r = {"epochs": [lower / epochs] * epochs, "bytes": None, "split": mode.split(":")[-1], "skipped": True}
                cpu1 = cpu0 = peak = 0
            else:
                tiers.reset_peak()
                cpu0, _ = tiers.usage()
                r = tiers.train(model, mode, cfg["batch"], epochs, overlap, cfg["limit"], train_secs)
                cpu1, peak = tiers.usage()
            row = dict(model=model, rate=rate, mode=mode, overlap=overlap, repeat=repeat, images=cfg["images"],
                       train_secs=train_secs, dtype=args.dtype,
                       batch=cfg["batch"], jpeg_bytes=jpeg_bytes, storage_cpu_secs=cpu1 - cpu0, storage_peak_rss=peak, **r,
                       **(extra or {}))
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            note = " (timeout)" if r.get("timeout") else " (skipped: lower bound)" if r.get("skipped") else ""
            print(f"[{time.time() - started:6.0f}s] {model} {rate} Mbit/s {mode} overlap={overlap}: "
                  f"{sum(r['epochs']):.1f}s{note}, {(r['bytes'] or 0) / 1e6:.1f} MB, split {r['split']}", flush=True)
            return sum(r["epochs"])

        for rate in cfg["rates"]:
            shape(rate)
            for model in cfg["models"]:
                # Late splits first: they are the likely winners, so the bound skips more early ones.
                modes = ["images"] + [f"split:{s}" for s in reversed(splits_to_freeze(model))] + ["tensors", "auto"]
                for repeat in range(cfg["repeats"]):
                    best = None
                    for mode in modes:
                        t = record(model, rate, mode, True, 1, repeat, best=best)
                        best = t if best is None else min(best, t)
        for rate in cfg["ablation"]:
            shape(rate)
            for model in cfg["models"]:
                for repeat in range(cfg["repeats"] if rate in cfg["rates"] else 1):
                    for mode in ("images", f"split:{splits_to_freeze(model)[-1]}", "auto"):
                        for overlap in (True, False):
                            record(model, rate, mode, overlap, 1, repeat, train_secs=cfg.get("ablation_train_secs"),
                                   extra={"ablation": True})
        if cfg.get("augment_epochs"):
            model = cfg["models"][0]
            freeze = splits_to_freeze(model)[-1]
            for rate, mode in ((10, "images+augment"), (10, f"split:{freeze}+augment"), (1000, f"split:{freeze}+augment")):
                shape(rate)
                # The production default: the cache on (an augmented output is not kept for the
                # next epoch, which draws anew), on a restarted gateway.
                tiers.restart_gateway(cache=True)
                tiers.split_bytes(model)
                record(model, rate, mode, True, cfg["augment_epochs"], 0, tiers=tiers, extra={"augment": True})
            # The storage core's floor for what an augmented epoch must still compute, beside it.
            floor = json.loads(tiers.in_storage([sys.executable, str(ROOT / "bench/repro/floor.py"), model, freeze,
                                                 str(cfg["images"]), str(AUGMENT_SEED), "1"]))
            with out.open("a") as f:
                f.write(json.dumps(dict(model=model, mode="floor+augment", images=cfg["images"], **floor)) + "\n")
            print(f"floor: {floor['images_per_sec']:.1f} img/s, {cfg['images'] / floor['images_per_sec']:.2f} s an epoch",
                  flush=True)
        if cfg["cache_epochs"]:
            shape(25)
            model = "resnet50-thin" if "resnet50-thin" in cfg["models"] else cfg["models"][-1]
            best = None
            # The baselines as HAPI runs them (every epoch moves and recomputes), `auto` with the
            # gateway's cache, and both with the compute tier keeping features too (`+local`).
            for mode in ("images", "tensors", "auto", "auto+local", "images+local"):
                # Each run starts with an empty cache. The gateway is long-running in production
                # and measures its split costs once in its life: that is done before the clock.
                tiers.restart_gateway(cache=True)
                tiers.split_bytes(model)
                t = record(model, 25, mode, True, cfg["cache_epochs"], 0, tiers=tiers, extra={"cache": True}, best=best)
                best = t if best is None else min(best, t)
    finally:
        if tiers:
            tiers.stop()
        if namespaces:
            subprocess.run([str(TOPOLOGY), "down"], check=False)
    print(f"results: {out} ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
