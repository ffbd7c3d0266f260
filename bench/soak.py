"""Bounded soak test under faults: the release gateway in front of SeaweedFS, N clients for T
seconds, while the store is killed (SIGKILL) and restarted three times and the gateway gets one
SIGTERM and restart.

Run: .venv/bin/python bench/soak.py [--seconds 600] [--clients 32]
     (after scripts/setup.sh and cargo build --release; it builds nothing).

The clients (one boto3 client per thread, no retries, connect 2 s / read 30 s) mix:
  put           PUT of 1 KiB .. 1 MiB with a CRC32, SHA256 or Content-MD5 checksum (or none)
  multipart     two parts (5 MiB + up to 1 MiB), about 1 op in 20
  get / head    re-reads of the client's own acknowledged objects (sha256 / length checked),
                ranged reads of shared seed blobs
  list          ListObjectsV2 of the client's prefix
  pd_image      pushdown GET (tiny-cnn, split pool) of a PNG or JPEG: .npy, same bytes every time
  pd_shard      pushdown GET of a WebDataset shard: safetensors, labels and shape checked
  hostile       pushdown GET of an object built to hurt (1 x 65535 PNG, 100000 x 100000 header,
                truncated JPEG, junk bytes, shard with a junk member): must answer 4xx
  abort_put     raw-socket PUT, validly signed for the full body, closed after half (FIN or RST):
                the key must not be created, or must keep its previous content
  abort_get     raw-socket GET of a 1 MiB blob closed after a few KiB

Faults, at fixed fractions of the run: the store is killed at 20 %, 45 % and 70 % and restarted
on its data after a few seconds; the gateway gets SIGTERM at 85 % (it must drain and exit 0) and
is started again with the same arguments.

Measured and reported (markdown on stdout and in bench/results/soak.md, raw JSON in
bench/results/soak.json; the gateway's log goes to .tmp/soak-gateway.log):
  - requests by op and outcome, in calm periods and in fault windows (a fault window runs from
    the fault to 5 s after the service is back; a request counts in it if it overlaps it);
  - every acknowledged write re-read at the end through the gateway and straight from the store:
    lost (by the store: gone from the store too, after a kill; by the gateway: anything else) and
    corrupt; unacknowledged and aborted writes must be absent or whole;
  - gateway crashes (any exit but the planned SIGTERM; it is restarted so the soak goes on);
  - peak RSS of the gateway (VmRSS sampled every 0.5 s, VmHWM, which the gateway's memory probes
    reset, and its peak-resident gauge) against idle RSS + the pushdown memory budget + the tensor
    cache + the documented 64 MiB overhead;
  - time from the store answering again to the first 2xx through the gateway.

Exit status 1 on a gateway crash, a write acknowledged and lost by the gateway, a corrupt object or
read, a hostile object answered 2xx (or 5xx outside fault windows), a pushdown answer that changed,
or any 5xx outside fault windows.
"""

import argparse
import atexit
import base64
import collections
import concurrent.futures as cf
import ctypes
import hashlib
import io
import json
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import boto3
import numpy as np
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import BotoCoreError, ClientError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from test_pushdown import synthetic_photo, tar_of  # noqa: E402

TMP = ROOT / ".tmp"
RESULTS = ROOT / "bench" / "results"
GATEWAY_LOG = TMP / "soak-gateway.log"
BINARY = ROOT / "target" / "release" / "tensorgate"

STORE_PORT, GW_PORT, ADMIN_PORT = 19133, 19233, 19234
STORE_URL = f"http://127.0.0.1:{STORE_PORT}"
GW_URL = f"http://127.0.0.1:{GW_PORT}"
ADMIN_URL = f"http://127.0.0.1:{ADMIN_PORT}"
STORE_AK, STORE_SK = "seaweed-ak", "seaweed-sk"
GW_AK, GW_SK = "soak-ak", "soak-sk"
BUCKET = "soak"
MODEL, SPLIT = "tiny-cnn", "pool"

KIB, MIB = 1 << 10, 1 << 20
MEMORY_BUDGET = 512 * MIB  # [pushdown] memory_budget
CACHE_BYTES = 64 * MIB  # [pushdown.cache] memory_bytes
OVERHEAD = 64 * MIB  # what docs/pushdown.md allows beyond the budget
SHUTDOWN_GRACE_S = 30  # shutdown_grace_secs
FAULT_GRACE_S = 5.0  # a fault window lasts until this long after the service is back
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

# (op, weight): multipart about 1 in 20.
OPS = [
    ("put", 22), ("get", 18), ("head", 4), ("list", 4), ("multipart", 5), ("pd_image", 16),
    ("pd_shard", 8), ("hostile", 8), ("abort_put", 6), ("abort_get", 5),
]  # fmt: skip
MAX_OPS_PER_CLIENT = 1_000_000  # a count bound besides the time bound


def now() -> float:
    """Seconds since the soak started."""
    return time.monotonic() - CLOCK_ZERO


CLOCK_ZERO = time.monotonic()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def b64_md5(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


def s3_client(endpoint: str, ak: str, sk: str, read_timeout: float = 30):
    """A boto3 client with no retries and short timeouts (one per thread)."""
    config = Config(
        retries={"max_attempts": 1}, connect_timeout=2, read_timeout=read_timeout,
        s3={"addressing_style": "path"}, signature_version="s3v4",
        request_checksum_calculation="when_required", response_checksum_validation="when_required",
    )  # fmt: skip
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id=ak, aws_secret_access_key=sk, region_name="us-east-1", config=config
    )


def status_class(status: int) -> str:
    if 200 <= status < 300:
        return "2xx"
    if status == 404:
        return "404"
    if status == 503:
        return "503"
    return "4xx" if 400 <= status < 500 else "5xx"


def error_status(e: ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def error_detail(e: ClientError) -> str:
    err = e.response.get("Error", {})
    return f"{error_status(e)} {err.get('Code', '')}: {str(err.get('Message', ''))[:160]}"


# --- processes: the store and the gateway -------------------------------------------------------


def become_subreaper() -> None:
    """Adopt orphaned descendants (SeaweedFS is started in the background by a script) so a killed
    store can be reaped here: where PID 1 does not reap, it would stay a zombie and look alive."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def reap(pid: int, timeout: float) -> bool:
    """Waits up to `timeout` for `pid` to be gone (reaping it if it is our child)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return True
        except ChildProcessError:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state in ("Z", "X"):
                    return True
            except (OSError, IndexError):
                return True
        time.sleep(0.05)
    return False


class Store:
    """SeaweedFS through scripts/seaweedfs.sh on STORE_PORT."""

    def __init__(self):
        self.env = {**os.environ, "SEAWEED_PORT": str(STORE_PORT)}
        self.pid_file = TMP / f"seaweedfs-{STORE_PORT}" / "pid"
        self.direct = s3_client(STORE_URL, STORE_AK, STORE_SK, read_timeout=5)

    def pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def leftovers(self) -> list[str]:
        out = subprocess.run(["pgrep", "-f", f"s3.port={STORE_PORT}"], capture_output=True, text=True)
        return out.stdout.split()

    def start(self, keep: bool) -> None:
        env = {**self.env, "SEAWEED_KEEP": "1" if keep else "0"}
        subprocess.run([str(ROOT / "scripts" / "seaweedfs.sh"), "start"], env=env, cwd=ROOT, check=True,
                       capture_output=True, timeout=120, start_new_session=True)  # fmt: skip

    def kill9(self) -> None:
        """A crash: SIGKILL the one `weed mini` process, then wait until nothing of it is left."""
        pid = self.pid()
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            reap(pid, 10)
        end = time.monotonic() + 15
        while self.leftovers() and time.monotonic() < end:
            time.sleep(0.1)

    def stop(self) -> None:
        pid = self.pid()
        if pid:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            if not reap(pid, 10):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                reap(pid, 5)
        subprocess.run([str(ROOT / "scripts" / "seaweedfs.sh"), "stop"], env=self.env, cwd=ROOT,
                       capture_output=True, timeout=30)  # fmt: skip

    def answering(self) -> bool:
        """A direct, signed ListBuckets succeeds."""
        try:
            self.direct.list_buckets()
            return True
        except (ClientError, BotoCoreError):
            return False


def read_status_kib(pid: int, field_name: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def scrape_metrics() -> dict[str, float]:
    """Counters and gauges of /metrics (histogram buckets left out)."""
    out = {}
    try:
        with urllib.request.urlopen(f"{ADMIN_URL}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return out
    for line in text.splitlines():
        if line.startswith("tensorgate_") and "_bucket{" not in line:
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


@dataclass
class Instance:
    """One gateway process: its memory figures and how it ended."""

    pid: int
    started_at: float
    ready_at: float | None = None
    idle_rss_kib: int | None = None
    peak_rss_kib: int = 0
    hwm_kib: int = 0
    metric_peak_bytes: float = 0
    exit_code: int | None = None
    exit_reason: str = ""


class Gateway:
    """The release gateway on GW_PORT; restarts itself after an unplanned exit (a crash)."""

    def __init__(self, config_path: Path):
        self.cmd = [
            str(BINARY), "serve", "--config", str(config_path), "--listen", f"127.0.0.1:{GW_PORT}",
            "--admin-listen", f"127.0.0.1:{ADMIN_PORT}", "--backend-endpoint", STORE_URL,
            "--backend-access-key", STORE_AK, "--backend-secret-key", STORE_SK,
            "--access-key", GW_AK, "--secret-key", GW_SK, "--models-dir", "models", "--log", "warn",
        ]  # fmt: skip
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORGATE_", "ORT_"))}
        self.lock = threading.RLock()
        self.proc: subprocess.Popen | None = None
        self.planned_stop = False
        self.instances: list[Instance] = []
        self.crashes: list[dict] = []
        self.metric_snapshots: list[dict] = []

    def start(self) -> float:
        """Starts a process and waits for /readyz; returns when it became ready."""
        with self.lock:
            with open(GATEWAY_LOG, "ab") as log:
                log.write(f"=== soak: gateway start at t={now():.1f}s ===\n".encode())
                log.flush()
                self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)  # fmt: skip
            inst = Instance(pid=self.proc.pid, started_at=now())
            self.instances.append(inst)
            self.planned_stop = False
            end = time.monotonic() + 60
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"gateway exited with {self.proc.returncode} while starting; see {GATEWAY_LOG}")
                try:
                    with urllib.request.urlopen(f"{ADMIN_URL}/readyz", timeout=1) as r:
                        if r.status == 200:
                            inst.ready_at = now()
                            inst.idle_rss_kib = read_status_kib(inst.pid, "VmRSS:")
                            return inst.ready_at
                except OSError:
                    time.sleep(0.1)
            raise RuntimeError(f"gateway not ready within 60 s; see {GATEWAY_LOG}")

    def sample(self) -> None:
        """Records RSS; notices an unplanned exit (a crash), records it and starts a new process."""
        with self.lock:
            if self.proc is None:
                return
            inst = self.instances[-1]
            rss = read_status_kib(inst.pid, "VmRSS:")
            hwm = read_status_kib(inst.pid, "VmHWM:")
            inst.peak_rss_kib = max(inst.peak_rss_kib, rss or 0)
            inst.hwm_kib = max(inst.hwm_kib, hwm or 0)
            rc = self.proc.poll()
            if rc is None or self.planned_stop:
                return
            inst.exit_code, inst.exit_reason = rc, "crash"
            self.crashes.append({"t": round(now(), 1), "pid": inst.pid, "exit_code": rc, "log_tail": log_tail(40)})
            print(f"soak: gateway exited unexpectedly with {rc} at t={now():.1f}s; restarting", file=sys.stderr)
            self.proc = None
            self.start()

    def snapshot(self, label: str) -> None:
        m = scrape_metrics()
        if m:
            inst = self.instances[-1]
            inst.metric_peak_bytes = max(inst.metric_peak_bytes, m.get("tensorgate_process_peak_resident_bytes", 0))
            self.metric_snapshots.append({"label": label, "pid": inst.pid, "metrics": m})

    def terminate(self, reason: str) -> tuple[int | None, float]:
        """SIGTERM and wait for the drain (the shutdown deadline plus a margin); (exit code, seconds)."""
        with self.lock:
            if self.proc is None:
                return None, 0.0
            self.planned_stop = True
            self.sample()
            proc, inst = self.proc, self.instances[-1]
        self.snapshot(f"before {reason}")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=SHUTDOWN_GRACE_S + 15)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait(timeout=10)
            reason += " (killed: did not exit after SIGTERM)"
        with self.lock:
            inst.exit_code, inst.exit_reason = rc, reason
            self.proc = None
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        """Last resort on exit."""
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                self.planned_stop = True
                self.proc.kill()
                self.proc.wait(timeout=10)


def log_tail(n: int) -> list[str]:
    try:
        return GATEWAY_LOG.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


# --- test objects -------------------------------------------------------------------------------


def image_bytes(img, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def make_images(n: int) -> dict[str, bytes]:
    """PNGs and JPEGs of 64 x 48 .. 200 x 150."""
    rng = random.Random(1)
    out = {}
    for i in range(n):
        w = rng.randint(64, 200)
        fmt = "PNG" if i % 2 == 0 else "JPEG"
        out[f"img/{i:03d}.{'png' if fmt == 'PNG' else 'jpg'}"] = image_bytes(synthetic_photo(w, w * 3 // 4, seed=i), fmt)
    return out


def make_shards(n: int, per_shard: int) -> dict[str, tuple[bytes, list[int]]]:
    """WebDataset shards (s/0001.jpg + s/0001.cls ...): key -> (tar bytes, labels)."""
    out = {}
    for s in range(n):
        members, labels = [], []
        for i in range(per_shard):
            fmt = "JPEG" if i % 2 else "PNG"
            img = image_bytes(synthetic_photo(64 + 16 * i, 48 + 12 * i, seed=1000 + s * 10 + i), fmt)
            label = s * 100 + i
            members += [(f"s/{i:04d}.{'jpg' if fmt == 'JPEG' else 'png'}", img), (f"s/{i:04d}.cls", str(label).encode())]
            labels.append(label)
        out[f"shard/{s:03d}.tar"] = (tar_of(members), labels)
    return out


def make_hostile() -> dict[str, bytes]:
    """Objects a pushdown must refuse with 4xx."""
    from PIL import Image

    png = image_bytes(synthetic_photo(64, 48, seed=5), "PNG")
    huge = bytearray(png)
    huge[16:24] = struct.pack(">II", 100000, 100000)  # IHDR width, height
    huge[29:33] = struct.pack(">I", zlib.crc32(bytes(huge[12:29])))  # keep the chunk's CRC valid
    jpeg = image_bytes(synthetic_photo(120, 90, seed=6), "JPEG")
    return {
        "hostile/tall-1x65535.png": image_bytes(Image.new("L", (1, 65535)), "PNG"),
        "hostile/huge-header.png": bytes(huge),
        "hostile/truncated.jpg": jpeg[: len(jpeg) // 2],
        "hostile/junk.bin": random.Random(7).randbytes(4096),
        "hostile/junk-member.tar": tar_of([("s/0001.jpg", b"\xff\xd8\xffnot a jpeg at all\xff\xd9"), ("s/0001.cls", b"1")]),
    }


# --- shared state -------------------------------------------------------------------------------


@dataclass
class Write:
    """One write attempt, on a key written once (so 'latest acknowledged content' is unambiguous)."""

    key: str
    sha: str
    size: int
    kind: str
    sent_at: float
    acked_at: float | None = None
    read_ok_at: float | None = None  # last verified read during the run


@dataclass
class Aborted:
    """A PUT cut off mid-body: the key must hold `prev_sha` (None: must not exist)."""

    key: str
    prev_sha: str | None
    at: float
    how: str


class Ledger:
    """Writes and aborted writes, for the final verification."""

    def __init__(self):
        self.lock = threading.Lock()
        self.writes: dict[str, Write] = {}
        self.aborted: list[Aborted] = []

    def sent(self, key: str, data_sha: str, size: int, kind: str) -> None:
        with self.lock:
            self.writes[key] = Write(key, data_sha, size, kind, now())

    def ack(self, key: str) -> None:
        with self.lock:
            self.writes[key].acked_at = now()

    def read_ok(self, key: str) -> None:
        with self.lock:
            self.writes[key].read_ok_at = now()

    def get(self, key: str) -> Write:
        with self.lock:
            return self.writes[key]

    def abort(self, key: str, prev_sha: str | None, how: str) -> None:
        with self.lock:
            self.aborted.append(Aborted(key, prev_sha, now(), how))


class PushdownRefs:
    """The first answer per object (sha256 and shape); later answers must be the same bytes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.first: dict[str, tuple[str, tuple]] = {}
        self.image_shape: tuple | None = None
        self.checked = collections.Counter()
        self.mismatches: list[dict] = []

    def check(self, key: str, data: bytes, shape: tuple, image: bool) -> bool:
        digest = sha256(data)
        with self.lock:
            self.checked[key] += 1
            if image and self.image_shape is None:
                self.image_shape = shape
            if image and shape != self.image_shape:
                self.mismatches.append({"key": key, "t": round(now(), 1), "why": f"shape {shape} != {self.image_shape}"})
                return False
            ref = self.first.setdefault(key, (digest, shape))
            if ref != (digest, shape):
                self.mismatches.append({"key": key, "t": round(now(), 1), "why": f"bytes or shape changed: {shape} vs {ref[1]}"})
                return False
            return True


@dataclass
class Event:
    op: str
    outcome: str
    t0: float
    t1: float


class Events:
    """Every client request's outcome; details of the unusual ones."""

    def __init__(self):
        self.lock = threading.Lock()
        self.items: list[Event] = []
        self.notes: list[dict] = []
        self.hostile = collections.Counter()  # "key status" -> count

    def add(self, op: str, outcome: str, t0: float, t1: float, detail: str = "") -> None:
        with self.lock:
            self.items.append(Event(op, outcome, t0, t1))
            if outcome not in ("2xx", "aborted") and not (op == "hostile" and outcome == "4xx") and len(self.notes) < 2000:
                self.notes.append({"op": op, "outcome": outcome, "t0": round(t0, 2), "t1": round(t1, 2), "detail": detail[:300]})

    def hostile_answer(self, key: str, status: int) -> None:
        with self.lock:
            self.hostile[f"{key} {status}"] += 1


@dataclass
class Fault:
    kind: str
    start: float
    end: float | None = None  # service back (store answering directly / gateway ready)
    down_s: float = 0.0
    first_gateway_2xx: float | None = None  # dedicated probe
    probe_attempts: collections.Counter = field(default_factory=collections.Counter)
    exit_code: int | None = None  # gateway SIGTERM: how it exited
    drain_s: float | None = None

    def window(self) -> tuple[float, float]:
        return self.start, (self.end if self.end is not None else float("inf")) + FAULT_GRACE_S


@dataclass
class Context:
    """What the clients share."""

    deadline: float
    stop: threading.Event
    ledger: Ledger
    events: Events
    refs: PushdownRefs
    images: list[str]
    shards: dict[str, list[int]]
    hostile: list[str]
    blobs: dict[str, bytes]  # seed blobs, kept for ranged reads and aborted GETs


# --- raw-socket requests ------------------------------------------------------------------------


def signed_head(method: str, key: str, payload_sha: str, length: int | None) -> bytes:
    """Request line and SigV4-signed headers for GW_URL/BUCKET/key (botocore's signer)."""
    path = f"/{BUCKET}/{key}"
    headers = {"Host": f"127.0.0.1:{GW_PORT}", "x-amz-content-sha256": payload_sha, "Connection": "close"}
    if length is not None:
        headers["Content-Length"] = str(length)
    req = AWSRequest(method=method, url=GW_URL + path, headers=headers)
    SigV4Auth(Credentials(GW_AK, GW_SK), "s3", "us-east-1").add_auth(req)
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in req.headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def close_socket(sock: socket.socket, reset: bool) -> None:
    """Close with FIN, or with RST (SO_LINGER 0) as a crashed client would."""
    if reset:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


# --- clients ------------------------------------------------------------------------------------


class Client(threading.Thread):
    """One client: random ops until the deadline, on its own key space c<id>/."""

    def __init__(self, cid: int, ctx: Context):
        super().__init__(daemon=True, name=f"client-{cid}")
        self.cid, self.ctx = cid, ctx
        self.rng = random.Random(1000 + cid)
        self.n = 0
        self.mine: list[str] = []  # acknowledged keys of this client
        self.pushdown_headers: dict[str, str] = {}

    def run(self) -> None:
        self.s3 = s3_client(GW_URL, GW_AK, GW_SK)
        self.s3.meta.events.register_first("before-sign.s3.GetObject", self._add_pushdown_headers)
        ops, weights = zip(*OPS)
        for _ in range(MAX_OPS_PER_CLIENT):
            if self.ctx.stop.is_set() or now() >= self.ctx.deadline:
                break
            self.do(self.rng.choices(ops, weights)[0])

    def do(self, op: str) -> None:
        t0 = now()
        try:
            outcome, detail = getattr(self, f"op_{op}")()
        except ClientError as e:
            outcome, detail = status_class(error_status(e)), error_detail(e)
        except (BotoCoreError, OSError) as e:
            outcome, detail = "conn-error", f"{type(e).__name__}: {e}"
        except Exception as e:  # a bug of this script: shown, not hidden
            outcome, detail = "script-error", "".join(traceback.format_exception(e))[-600:]
        self.ctx.events.add(op, outcome, t0, now(), detail)
        if outcome in ("conn-error", "503"):
            time.sleep(0.2)  # do not spin while the gateway is away

    def new_key(self, kind: str) -> str:
        self.n += 1
        return f"c{self.cid:02d}/{kind}{self.n:06d}"

    def _add_pushdown_headers(self, request, **_):
        for k, v in self.pushdown_headers.items():
            request.headers[k] = v

    def pushdown(self, key: str) -> tuple[bytes, str]:
        self.pushdown_headers = {"x-tensorgate-model": MODEL, "x-tensorgate-split": SPLIT}
        try:
            r = self.s3.get_object(Bucket=BUCKET, Key=key)
        finally:
            self.pushdown_headers = {}
        return r["Body"].read(), r["ContentType"]

    # Each op returns (outcome, detail) or raises (classified by `do`).

    def op_put(self):
        key = self.new_key("o")
        body = self.rng.randbytes(int(KIB * 1024 ** self.rng.random()))
        variant = self.rng.choice(("crc32", "sha256", "md5", "plain"))
        kw = {"crc32": {"ChecksumAlgorithm": "CRC32"}, "sha256": {"ChecksumAlgorithm": "SHA256"},
              "md5": {"ContentMD5": b64_md5(body)}, "plain": {}}[variant]  # fmt: skip
        self.ctx.ledger.sent(key, sha256(body), len(body), f"put-{variant}")
        r = self.s3.put_object(Bucket=BUCKET, Key=key, Body=body, **kw)
        self.ctx.ledger.ack(key)
        self.mine.append(key)
        if r["ETag"].strip('"') != hashlib.md5(body).hexdigest():
            return "corrupt", f"{key}: ETag {r['ETag']} is not the body's MD5"
        return "2xx", variant

    def op_multipart(self):
        key = self.new_key("m")
        parts = [self.rng.randbytes(5 * MIB), self.rng.randbytes(self.rng.randint(KIB, MIB))]
        self.ctx.ledger.sent(key, sha256(b"".join(parts)), sum(map(len, parts)), "multipart")
        upload = self.s3.create_multipart_upload(Bucket=BUCKET, Key=key)["UploadId"]
        try:
            done = []
            for i, part in enumerate(parts, 1):
                r = self.s3.upload_part(Bucket=BUCKET, Key=key, UploadId=upload, PartNumber=i, Body=part, ContentMD5=b64_md5(part))
                done.append({"ETag": r["ETag"], "PartNumber": i})
            self.s3.complete_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload, MultipartUpload={"Parts": done})
        except Exception:
            try:
                self.s3.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload)
            except (ClientError, BotoCoreError):
                pass
            raise
        self.ctx.ledger.ack(key)
        self.mine.append(key)
        return "2xx", ""

    def op_get(self):
        if not self.mine or self.rng.random() < 0.25:
            return self.ranged_blob_get()
        key = self.rng.choice(self.mine)
        want = self.ctx.ledger.get(key)
        body = self.s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        if sha256(body) != want.sha:
            return "corrupt", f"{key}: {len(body)} bytes, want {want.size}, sha256 differs"
        self.ctx.ledger.read_ok(key)
        return "2xx", ""

    def ranged_blob_get(self):
        key, data = self.rng.choice(list(self.ctx.blobs.items()))
        a = self.rng.randrange(len(data))
        b = min(len(data) - 1, a + self.rng.randint(0, 256 * KIB))
        body = self.s3.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={a}-{b}")["Body"].read()
        if body != data[a : b + 1]:
            return "corrupt", f"{key} bytes={a}-{b}: {len(body)} bytes, content differs"
        return "2xx", "range"

    def op_head(self):
        if not self.mine:
            return self.op_list()
        key = self.rng.choice(self.mine)
        r = self.s3.head_object(Bucket=BUCKET, Key=key)
        want = self.ctx.ledger.get(key).size
        if r["ContentLength"] != want:
            return "corrupt", f"{key}: HEAD length {r['ContentLength']}, want {want}"
        return "2xx", ""

    def op_list(self):
        self.s3.list_objects_v2(Bucket=BUCKET, Prefix=f"c{self.cid:02d}/", MaxKeys=100)
        return "2xx", ""

    def op_pd_image(self):
        key = self.rng.choice(self.ctx.images)
        data, ctype = self.pushdown(key)
        if ctype != "application/x-npy":
            return "mismatch", f"{key}: content-type {ctype}"
        a = np.load(io.BytesIO(data))
        if not np.isfinite(a).all():
            return "mismatch", f"{key}: non-finite values"
        if not self.ctx.refs.check(key, data, a.shape, image=True):
            return "mismatch", f"{key}: answer differs from the first (shape {a.shape})"
        return "2xx", ""

    def op_pd_shard(self):
        key = self.rng.choice(list(self.ctx.shards))
        data, ctype = self.pushdown(key)
        if ctype != "application/vnd.safetensors":
            return "mismatch", f"{key}: content-type {ctype}"
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        lo, hi = header["labels"]["data_offsets"]
        labels = np.frombuffer(data[8 + n + lo : 8 + n + hi], dtype=np.int64).tolist()
        shape = tuple(header["features"]["shape"])
        want = self.ctx.shards[key]
        if labels != want or shape[0] != len(want):
            return "mismatch", f"{key}: labels {labels} / shape {shape}, want labels {want}"
        if not self.ctx.refs.check(key, data, shape, image=False):
            return "mismatch", f"{key}: answer differs from the first"
        return "2xx", ""

    def op_hostile(self):
        key = self.rng.choice(self.ctx.hostile)
        try:
            data, _ = self.pushdown(key)
        except ClientError as e:
            self.ctx.events.hostile_answer(key, error_status(e))
            raise
        self.ctx.events.hostile_answer(key, 200)
        return "2xx", f"{key}: answered 2xx with {len(data)} bytes"

    def op_abort_put(self):
        """Signed for the whole body, half sent, then the connection closed."""
        prev = [k for k in self.mine if "/o" in k]
        key = self.rng.choice(prev) if prev and self.rng.random() < 0.5 else self.new_key("a")
        prev_sha = self.ctx.ledger.get(key).sha if key in self.mine else None
        body = self.rng.randbytes(self.rng.randint(64 * KIB, 512 * KIB))
        reset = self.rng.random() < 0.5
        sock = socket.create_connection(("127.0.0.1", GW_PORT), timeout=5)
        try:
            sock.sendall(signed_head("PUT", key, sha256(body), len(body)) + body[: len(body) // 2])
            time.sleep(self.rng.random() * 0.2)  # let some of it reach the store
        finally:
            close_socket(sock, reset)
        self.ctx.ledger.abort(key, prev_sha, "rst" if reset else "fin")
        return "aborted", ""

    def op_abort_get(self):
        """A GET of a 1 MiB blob read for a few KiB, then closed; returns the status it got."""
        key = self.rng.choice([k for k in self.ctx.blobs if len(self.ctx.blobs[k]) >= MIB])
        sock = socket.create_connection(("127.0.0.1", GW_PORT), timeout=10)
        got = b""
        try:
            sock.sendall(signed_head("GET", key, EMPTY_SHA256, None))
            want = self.rng.randint(1, 16) * KIB
            while len(got) < want:
                chunk = sock.recv(16 * KIB)
                if not chunk:
                    break
                got += chunk
        finally:
            close_socket(sock, self.rng.random() < 0.5)
        status_line = got.split(b"\r\n", 1)[0].decode(errors="replace")
        parts = status_line.split()
        if len(parts) < 2 or not parts[1].isdigit():
            return "conn-error", f"no status line: {status_line[:80]!r}"
        return status_class(int(parts[1])), status_line


# --- faults -------------------------------------------------------------------------------------


def probe_gateway(probe, fault: Fault, key: str, stop: threading.Event) -> None:
    """GETs through the gateway every 50 ms until one answers 2xx (60 s at most)."""
    end = time.monotonic() + 60
    while time.monotonic() < end and not stop.is_set():
        try:
            probe.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            fault.probe_attempts["2xx"] += 1
            fault.first_gateway_2xx = now()
            return
        except ClientError as e:
            fault.probe_attempts[str(error_status(e))] += 1
        except (BotoCoreError, OSError):
            fault.probe_attempts["conn-error"] += 1
        time.sleep(0.05)


def store_crash(store: Store, down_s: float, probe, probe_key: str, stop: threading.Event) -> Fault:
    fault = Fault("store kill -9", now())
    store.kill9()
    if store.leftovers():
        print(f"soak: store processes left after kill: {store.leftovers()}", file=sys.stderr)
    stop.wait(down_s)
    store.start(keep=True)
    end = time.monotonic() + 60
    while not store.answering() and time.monotonic() < end:
        time.sleep(0.1)
    fault.end = now()
    fault.down_s = fault.end - fault.start
    probe_gateway(probe, fault, probe_key, stop)
    return fault


def gateway_restart(gateway: Gateway, probe, probe_key: str, stop: threading.Event) -> Fault:
    fault = Fault("gateway SIGTERM", now())
    fault.exit_code, fault.drain_s = gateway.terminate("planned SIGTERM")
    fault.end = gateway.start()
    fault.down_s = fault.end - fault.start
    probe_gateway(probe, fault, probe_key, stop)
    return fault


def store_down_s(seconds: float) -> float:
    """How long the store stays dead per crash: 7.5 s on a 600 s run, 3 s on short ones."""
    return min(8.0, max(3.0, seconds / 80))


def run_faults(seconds: float, store: Store, gateway: Gateway, probe_key: str, stop: threading.Event) -> list[Fault]:
    """The schedule: store crashes at 20/45/70 %, gateway SIGTERM at 85 %; each starts when due or
    when the previous one has finished, whichever is later."""
    probe = s3_client(GW_URL, GW_AK, GW_SK, read_timeout=10)
    down_s = store_down_s(seconds)
    faults = []
    for frac, kind in [(0.20, "store"), (0.45, "store"), (0.70, "store"), (0.85, "gateway")]:
        if stop.wait(max(0.0, frac * seconds - now())):
            break
        print(f"soak: t={now():.0f}s {kind} fault", file=sys.stderr)
        if kind == "store":
            faults.append(store_crash(store, down_s, probe, probe_key, stop))
        else:
            faults.append(gateway_restart(gateway, probe, probe_key, stop))
    return faults


def monitor(gateway: Gateway, stop: threading.Event, done: threading.Event) -> None:
    """Every 0.5 s: RSS sample, crash check (and restart)."""
    while not done.wait(0.5):
        try:
            gateway.sample()
        except RuntimeError as e:  # the restart failed: nothing more to soak
            print(f"soak: {e}", file=sys.stderr)
            stop.set()
            return


# --- final verification -------------------------------------------------------------------------


def read_sha(client, key: str, attempts: int = 4) -> tuple[str, str | None]:
    """('ok', sha256) | ('404', None) | ('error', detail), retrying errors that are not 404."""
    detail = ""
    for i in range(attempts):
        try:
            return "ok", sha256(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        except ClientError as e:
            if error_status(e) == 404:
                return "404", None
            detail = error_detail(e)
        except (BotoCoreError, OSError) as e:
            detail = f"{type(e).__name__}: {e}"
        time.sleep(0.5 * (i + 1))
    return "error", detail


def classify_write(w: Write, gw: tuple, st: tuple, kills: list[float]) -> str:
    """The verdict on one write attempt, from the gateway's and the store's answers."""
    (g, gsha), (s, ssha) = gw, st
    if "error" in (g, s):
        return "unverifiable"
    if w.acked_at is None:  # unacknowledged: absent or whole, never partial
        if g == "404" and s == "404":
            return "unacked: absent"
        if gsha == w.sha and ssha == w.sha:
            return "unacked: whole"
        return "corrupt (unacked write partial, different or inconsistent)"
    if gsha == w.sha and ssha == w.sha:
        return "ok"
    if g == "404" and s == "404":
        # Blamed on the store (SeaweedFS durability across kill -9) if it was read back after the
        # ack or a kill came after the ack; soak.json lists each with the delay to that kill.
        if w.read_ok_at is not None or any(k >= w.acked_at for k in kills):
            return "lost by the store"
        return "lost by the gateway"
    if g == "404":
        return "lost by the gateway"  # the store has it, the gateway says 404
    if s == "404":
        return "inconsistent: store 404, gateway served it"
    return "corrupt (gateway)" if gsha != w.sha and ssha == w.sha else "corrupt (store)"


def classify_abort(a: Aborted, gw: tuple, st: tuple) -> str:
    (g, gsha), (s, ssha) = gw, st
    if "error" in (g, s):
        return "unverifiable"
    if a.prev_sha is None:
        return "not created" if (g, s) == ("404", "404") else "created (partial body stored)"
    return "previous content kept" if gsha == a.prev_sha and ssha == a.prev_sha else "previous content replaced"


def verify(ledger: Ledger, kills: list[float]) -> dict:
    """Re-reads every write attempt and aborted key through the gateway and from the store."""
    gw_tl, st_tl = threading.local(), threading.local()

    def clients():
        if not hasattr(gw_tl, "c"):
            gw_tl.c = s3_client(GW_URL, GW_AK, GW_SK)
            st_tl.c = s3_client(STORE_URL, STORE_AK, STORE_SK)
        return gw_tl.c, st_tl.c

    def both(key):
        g, s = clients()
        return read_sha(g, key), read_sha(s, key)

    writes = list(ledger.writes.values())
    aborted = list(ledger.aborted)
    with cf.ThreadPoolExecutor(8) as pool:
        w_answers = list(pool.map(lambda w: both(w.key), writes))
        a_answers = list(pool.map(lambda a: both(a.key), aborted))
    out = {"writes": collections.Counter(), "aborted": collections.Counter(), "bad": []}
    for w, (g, s) in zip(writes, w_answers):
        verdict = classify_write(w, g, s, kills)
        out["writes"][verdict] += 1
        if verdict not in ("ok", "unacked: absent", "unacked: whole"):
            later = [k - w.acked_at for k in kills if w.acked_at is not None and k >= w.acked_at]
            out["bad"].append({**asdict(w), "verdict": verdict, "gateway": g[0], "store": s[0],
                               "next_kill_after_ack_s": round(min(later), 2) if later else None})  # fmt: skip
    for a, (g, s) in zip(aborted, a_answers):
        verdict = classify_abort(a, g, s)
        out["aborted"][verdict] += 1
        if verdict not in ("not created", "previous content kept"):
            out["bad"].append({**asdict(a), "verdict": verdict, "gateway": g[0], "store": s[0]})
    out["acked"] = sum(1 for w in writes if w.acked_at is not None)
    return out


def recheck_pushdown(ctx: Context) -> list[str]:
    """After the faults: one more pushdown of every image and shard, against the first answers."""
    c = Client(99, ctx)
    c.s3 = s3_client(GW_URL, GW_AK, GW_SK)
    c.s3.meta.events.register_first("before-sign.s3.GetObject", c._add_pushdown_headers)
    problems = []
    for key in ctx.images + list(ctx.shards):
        try:
            data, _ = c.pushdown(key)
        except (ClientError, BotoCoreError, OSError) as e:
            problems.append(f"{key}: {e}")
            continue
        ref = ctx.refs.first.get(key)
        if ref is not None and ref[0] != sha256(data):
            problems.append(f"{key}: bytes differ from the first answer")
    return problems


# --- report -------------------------------------------------------------------------------------


def in_fault(e: Event, windows: list[tuple[float, float]]) -> bool:
    return any(e.t0 <= end and e.t1 >= start for start, end in windows)


def summarize(events: Events, faults: list[Fault]) -> dict:
    windows = [f.window() for f in faults]
    table = collections.defaultdict(lambda: collections.Counter())
    for e in events.items:
        table[(e.op, e.outcome)]["fault" if in_fault(e, windows) else "calm"] += 1
    return {f"{op} {outcome}": dict(c) for (op, outcome), c in sorted(table.items())}


def failures(res: dict) -> list[str]:
    out = []
    if res["crashes"]:
        out.append(f"{len(res['crashes'])} gateway crash(es)")
    for f in res["faults"]:
        if f["kind"] == "gateway SIGTERM" and f["exit_code"] != 0:
            out.append(f"gateway exited {f['exit_code']} after SIGTERM (want 0)")
    w = res["verification"]["writes"]
    for verdict, n in w.items():
        if verdict.startswith(("lost by the gateway", "corrupt", "inconsistent")):
            out.append(f"{n} write(s): {verdict}")
    for verdict, n in res["verification"]["aborted"].items():
        if verdict not in ("not created", "previous content kept", "unverifiable"):
            out.append(f"{n} aborted write(s): {verdict}")
    for row, c in res["outcomes"].items():
        op, outcome = row.split(" ", 1)
        calm = c.get("calm", 0)
        if outcome in ("corrupt", "mismatch", "script-error") and sum(c.values()):
            out.append(f"{sum(c.values())} {op} answered {outcome}")
        elif op == "hostile" and outcome == "2xx":
            out.append(f"{sum(c.values())} hostile object(s) answered 2xx")
        elif outcome in ("5xx", "503") and calm:
            out.append(f"{calm} {op} answered {outcome} outside fault windows")
    if res["pushdown"]["recheck_problems"]:
        out.append(f"pushdown recheck: {len(res['pushdown']['recheck_problems'])} problem(s)")
    return out


def warnings_of(res: dict) -> list[str]:
    out = []
    for row, c in res["outcomes"].items():
        op, outcome = row.split(" ", 1)
        if outcome in ("conn-error", "404", "4xx") and op != "hostile" and c.get("calm"):
            out.append(f"{c['calm']} {op} {outcome} outside fault windows")
    lost_store = res["verification"]["writes"].get("lost by the store", 0)
    if lost_store:
        out.append(f"{lost_store} acknowledged write(s) lost by the store (SeaweedFS durability across kill -9)")
    if res["verification"]["writes"].get("unverifiable"):
        out.append(f"{res['verification']['writes']['unverifiable']} write(s) could not be re-read")
    if not res["memory"]["within"]:
        out.append("peak RSS above idle + budget + cache + overhead")
    return out


def md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def render(res: dict) -> str:
    cfg = res["config"]
    out = [f"# Soak under faults: {cfg['clients']} clients, {cfg['seconds']} s", ""]
    out.append(f"Verdict: **{'PASS' if not res['failures'] else 'FAIL'}**. Release gateway in front of SeaweedFS, "
               f"pushdown memory_budget {cfg['memory_budget'] >> 20} MiB, cache {cfg['cache_bytes'] >> 20} MiB, "
               f"store down ~{cfg['store_down_s']:.0f} s per crash, fault window = fault .. service back + {FAULT_GRACE_S:.0f} s.")  # fmt: skip
    out += ["", "## Requests by outcome", ""]
    rows = [[*row.split(" ", 1), c.get("calm", 0), c.get("fault", 0)] for row, c in res["outcomes"].items()]
    out.append(md_table(["op", "outcome", "calm", "fault window"], rows))
    total = sum(r[2] + r[3] for r in rows)
    out.append(f"\n{total} requests, {total / cfg['seconds']:.1f}/s. Hostile answers (key: status x count): "
               + ", ".join(f"{k.split('/')[-1]} x{n}" for k, n in sorted(res["hostile_answers"].items())))  # fmt: skip
    out += ["", "## Faults", ""]
    rows = []
    for f in res["faults"]:
        back = f["end"]
        first = f["first_gateway_2xx"]
        extra = f"exit {f['exit_code']} after {f['drain_s']:.1f} s drain" if f["kind"] == "gateway SIGTERM" else ""
        rows.append([f["kind"], f"{f['start']:.1f}", f"{back:.1f}" if back else "never", f"{f['down_s']:.1f}",
                     f"{first - back:.2f}" if first and back else "never", f["client_first_2xx_after_s"], extra])  # fmt: skip
    out.append(md_table(["fault", "at s", "back at s", "down s", "back -> first gateway 2xx (probe) s",
                         "back -> first client 2xx s", "notes"], rows))  # fmt: skip
    v = res["verification"]
    out += ["", "## Writes re-read at the end (gateway and store)", ""]
    out.append(f"{v['acked']} acknowledged writes, {sum(v['writes'].values())} attempts, {len(res['aborted_list'])} aborted PUTs "
               f"(re-read in {v['seconds']} s).\n")  # fmt: skip
    out.append(md_table(["write verdict", "count"], sorted(v["writes"].items())))
    out.append("")
    out.append(md_table(["aborted PUT verdict", "count"], sorted(v["aborted"].items())))
    m = res["memory"]
    out += ["", "## Gateway process", ""]
    out.append(f"Crashes: **{len(res['crashes'])}**. Instances: "
               + "; ".join(f"pid {i['pid']} ({i['exit_reason'] or 'running'}, exit {i['exit_code']})" for i in res["instances"]))  # fmt: skip
    out.append("")
    out.append(md_table(["memory", "MiB"], [
        ["idle RSS after start (base)", m["base_mib"]], ["limit: base + budget + cache + 64 MiB overhead", m["limit_mib"]],
        ["peak VmRSS (0.5 s samples)", m["peak_rss_mib"]], ["peak VmHWM", m["peak_hwm_mib"]],
        ["tensorgate_process_peak_resident_bytes", m["metric_peak_mib"]], ["within limit", "yes" if m["within"] else "NO"],
    ]))  # fmt: skip
    out += ["", "## Pushdown", ""]
    p = res["pushdown"]
    out.append(f"{p['answers_checked']} answers compared with the first per object ({p['objects']} objects), "
               f"image output shape {p['image_shape']}; mismatches: {len(p['mismatches'])}; "
               f"recheck after the faults: {len(p['recheck_problems'])} problem(s).")  # fmt: skip
    out.append(f"\nGateway log ({GATEWAY_LOG.relative_to(ROOT)}): {res['log']['lines']} lines, "
               f"{res['log']['error']} ERROR, {res['log']['warn']} WARN, {res['log']['panic']} panic.")  # fmt: skip
    if res["log"]["warn_kinds"]:
        out.append("")
        out.append(md_table(["gateway WARN (op status error)", "lines"], list(res["log"]["warn_kinds"].items())))
    out += ["", "## Failures", ""] + ([f"- {x}" for x in res["failures"]] or ["none"])
    out += ["", "## Warnings", ""] + ([f"- {x}" for x in res["warnings"]] or ["none"])
    return "\n".join(out) + "\n"


def first_client_2xx(events: Events, after: float) -> float | None:
    ts = [e.t1 for e in events.items if e.outcome == "2xx" and e.t0 >= after]
    return min(ts) - after if ts else None


def memory_summary(gateway: Gateway) -> dict:
    insts = gateway.instances
    base = max((i.idle_rss_kib or 0) for i in insts) * KIB
    peak = max(i.peak_rss_kib for i in insts) * KIB
    hwm = max(i.hwm_kib for i in insts) * KIB
    metric = max(i.metric_peak_bytes for i in insts)
    limit = base + MEMORY_BUDGET + CACHE_BYTES + OVERHEAD
    return {"base_mib": base >> 20, "limit_mib": limit >> 20, "peak_rss_mib": peak >> 20, "peak_hwm_mib": hwm >> 20,
            "metric_peak_mib": int(metric) >> 20, "within": max(peak, hwm) <= limit}  # fmt: skip


def log_summary() -> dict:
    lines = log_tail(10**7)
    return {
        "lines": len(lines),
        "error": sum(" ERROR " in l or '"level":"ERROR"' in l for l in lines),
        "warn": sum(" WARN " in l or '"level":"WARN"' in l for l in lines),
        "panic": sum("panicked" in l for l in lines),
        "notable": [l for l in lines if " ERROR " in l or "panicked" in l][:50],
        "warn_kinds": dict(collections.Counter(warn_kind(l) for l in lines if " WARN " in l).most_common(10)),
    }


def warn_kind(line: str) -> str:
    """'op status error' of a gateway WARN line (the request-failure lines name them)."""
    fields = {}
    for name in ("op", "status", "error"):
        at = line.find(f" {name}=")
        if at >= 0:
            rest = line[at + len(name) + 2 :]
            fields[name] = rest[1 : rest.find('"', 1)] if rest.startswith('"') else rest.split(" ", 1)[0]
    return " ".join(fields.get(k, "?") for k in ("op", "status", "error")) if fields else line[28:120]


# --- main ---------------------------------------------------------------------------------------


def seed(s3, images, shards, hostile, blobs, probe_key, ledger: Ledger) -> None:
    """Objects the clients read: written through the gateway and counted as acknowledged writes."""
    try:
        s3.create_bucket(Bucket=BUCKET)
    except ClientError as e:
        if e.response["Error"]["Code"] not in ("BucketAlreadyExists", "BucketAlreadyOwnedByYou"):
            raise
    objects = {**images, **{k: v[0] for k, v in shards.items()}, **hostile, **blobs, probe_key: b"probe"}
    for key, data in objects.items():
        ledger.sent(key, sha256(data), len(data), "seed")
        s3.put_object(Bucket=BUCKET, Key=key, Body=data)
        ledger.ack(key)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--clients", type=int, default=32)
    args = ap.parse_args()
    if not BINARY.exists():
        print(f"soak: {BINARY} missing: cargo build --release", file=sys.stderr)
        return 2
    TMP.mkdir(exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    GATEWAY_LOG.write_bytes(b"")
    become_subreaper()

    store = Store()
    cfg_path = TMP / "soak-gateway.toml"
    cfg_path.write_text(f"shutdown_grace_secs = {SHUTDOWN_GRACE_S}\n[pushdown]\nmemory_budget = {MEMORY_BUDGET}\n"
                        f"[pushdown.cache]\nmemory_bytes = {CACHE_BYTES}\n")  # fmt: skip
    gateway = Gateway(cfg_path)
    stop, done = threading.Event(), threading.Event()
    cleaned = []

    def cleanup():
        if cleaned:
            return
        cleaned.append(True)
        stop.set()
        done.set()
        gateway.kill()
        store.stop()

    atexit.register(cleanup)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    try:
        return soak(args, store, gateway, stop, done)
    except KeyboardInterrupt:
        print("soak: interrupted", file=sys.stderr)
        return 130
    finally:
        cleanup()


def soak(args, store: Store, gateway: Gateway, stop: threading.Event, done: threading.Event) -> int:
    """Setup, the timed run with its faults, the verification and the report; the exit status."""
    global CLOCK_ZERO
    if store.leftovers():
        store.stop()
    print("soak: starting the store and the gateway, seeding objects", file=sys.stderr)
    store.start(keep=False)
    gateway.start()
    images, shards, hostile = make_images(12), make_shards(4, 4), make_hostile()
    blob_rng = random.Random(3)
    blobs = {f"blob/{i}": blob_rng.randbytes(n) for i, n in enumerate([64 * KIB, MIB, MIB + 12345])}
    ledger, events, refs = Ledger(), Events(), PushdownRefs()
    probe_key = "probe/object"
    seed(s3_client(GW_URL, GW_AK, GW_SK), images, shards, hostile, blobs, probe_key, ledger)

    CLOCK_ZERO = time.monotonic()  # the soak's t = 0; setup happened "at 0"
    for inst in gateway.instances:
        inst.started_at = inst.ready_at = 0.0
    for w in ledger.writes.values():
        w.sent_at = w.acked_at = 0.0
    ctx = Context(deadline=args.seconds, stop=stop, ledger=ledger, events=events, refs=refs, images=list(images),
                  shards={k: v[1] for k, v in shards.items()}, hostile=list(hostile), blobs=blobs)  # fmt: skip
    threading.Thread(target=monitor, args=(gateway, stop, done), daemon=True).start()
    clients = [Client(i, ctx) for i in range(args.clients)]
    for c in clients:
        c.start()
    print(f"soak: {args.clients} clients for {args.seconds:.0f} s", file=sys.stderr)
    faults = run_faults(args.seconds, store, gateway, probe_key, stop)
    stop.wait(max(0.0, args.seconds - now()))
    for c in clients:  # each op is bounded by its timeouts; a multipart upload is 4 requests
        c.join(timeout=max(1.0, args.seconds + 150 - now()))
    stuck = [c.name for c in clients if c.is_alive()]
    print(f"soak: t={now():.0f}s clients done{f' (stuck: {stuck})' if stuck else ''}; verifying", file=sys.stderr)

    if not store.answering():  # the store must be up for the verification
        store.start(keep=True)
    gateway.sample()
    recheck = recheck_pushdown(ctx)
    t_verify = now()
    verification = verify(ledger, [f.start for f in faults if f.kind.startswith("store")])
    verification["seconds"] = round(now() - t_verify, 1)
    print(f"soak: verified {len(ledger.writes) + len(ledger.aborted)} keys in {verification['seconds']} s", file=sys.stderr)
    gateway.sample()
    gateway.snapshot("end")
    done.set()
    final_rc, _ = gateway.terminate("final SIGTERM")

    res = results(args, ctx, faults, gateway, verification, recheck)
    res["failures"] = failures(res)
    if final_rc != 0:
        res["failures"].append(f"gateway exited {final_rc} after the final SIGTERM (want 0)")
    if stuck:
        res["failures"].append(f"clients still running after the deadline: {stuck}")
    res["warnings"] = warnings_of(res)
    text = render(res)
    print(text)
    (RESULTS / "soak.md").write_text(text)
    (RESULTS / "soak.json").write_text(json.dumps(res, indent=1, default=str))
    return 1 if res["failures"] else 0


def fault_record(f: Fault, events: Events) -> dict:
    first = first_client_2xx(events, f.end) if f.end is not None else None
    rec = {k: v for k, v in asdict(f).items() if k != "probe_attempts"}
    rec["probe_attempts"] = dict(f.probe_attempts)
    rec["client_first_2xx_after_s"] = f"{first:.2f}" if first is not None else "never"
    return rec


def results(args, ctx: Context, faults: list[Fault], gateway: Gateway, verification: dict, recheck: list[str]) -> dict:
    """Everything measured, as JSON-able data (soak.json; render() makes soak.md of it)."""
    refs = ctx.refs
    return {
        "config": {"seconds": args.seconds, "clients": args.clients, "memory_budget": MEMORY_BUDGET,
                   "cache_bytes": CACHE_BYTES, "store_down_s": store_down_s(args.seconds), "ops": dict(OPS)},  # fmt: skip
        "outcomes": summarize(ctx.events, faults),
        "hostile_answers": dict(ctx.events.hostile),
        "faults": [fault_record(f, ctx.events) for f in faults],
        "verification": {**verification, "writes": dict(verification["writes"]), "aborted": dict(verification["aborted"])},
        "aborted_list": [asdict(a) for a in ctx.ledger.aborted],
        "crashes": gateway.crashes,
        "instances": [asdict(i) for i in gateway.instances],
        "memory": memory_summary(gateway),
        "pushdown": {"answers_checked": sum(refs.checked.values()), "objects": len(refs.checked),
                     "image_shape": refs.image_shape, "mismatches": refs.mismatches, "recheck_problems": recheck},  # fmt: skip
        "log": log_summary(),
        "notes": ctx.events.notes,
        "metrics": gateway.metric_snapshots,
    }


if __name__ == "__main__":
    sys.exit(main())
