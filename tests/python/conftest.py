"""Fixtures: a real SeaweedFS (scripts/seaweedfs.sh) and the real tensorgate binary in front of it."""

import contextlib
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import boto3
import pytest
from botocore.config import Config

ROOT = Path(__file__).resolve().parents[2]
# The gateway the tests start: the debug build scripts/test.sh makes, or TENSORGATE_BIN (the
# container test compares the image with the same binary outside it).
BINARY = Path(os.environ.get("TENSORGATE_BIN") or ROOT / "target" / "debug" / "tensorgate")
SEAWEED_PORT = 18633


def ort_library() -> str:
    """The libonnxruntime.so inside the venv's onnxruntime wheel (the independent reference uses
    the same build, through Python)."""
    import onnxruntime

    capi = Path(onnxruntime.__file__).parent / "capi"
    return str(next(capi.glob("libonnxruntime.so*")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int, taken=()) -> list[int]:
    """`n` free ports, distinct from each other and from `taken` (held open together while
    chosen: `free_port` called twice may name one port twice)."""
    with contextlib.ExitStack() as stack:
        out = []
        while len(out) < n:
            s = stack.enter_context(socket.socket())
            s.bind(("127.0.0.1", 0))
            if s.getsockname()[1] not in taken:
                out.append(s.getsockname()[1])
        return out


def wait_ready(admin: str, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tensorgate exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{admin}/readyz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("tensorgate did not become ready")


@contextlib.contextmanager
def run_gateway(tmp_path: Path, config: str = "", seaweed: str | None = None, env: dict | None = None,
                ports: tuple[int, int] | None = None):
    """Starts one more tensorgate with `config` (TOML) in front of SeaweedFS (when `seaweed` is
    its endpoint) or of a local directory, on `ports` (S3, admin; default: free ones). The dev key
    signs requests; yields (endpoint, admin, boto3 client, pid)."""
    port, admin_port = ports or (free_port(), free_port())
    cfg = tmp_path / f"gateway-{port}.toml"
    cfg.write_text(config)
    full = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORGATE_", "ORT_"))}
    full.update(
        TENSORGATE_CONFIG=str(cfg),
        TENSORGATE_LISTEN=f"127.0.0.1:{port}",
        TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin_port}",
        TENSORGATE_MODELS_DIR=str(ROOT / "models"),
        TENSORGATE_ORT_LIBRARY=ort_library(),
        TENSORGATE_LOG="info",
    )
    if seaweed:
        full.update(
            TENSORGATE_BACKEND_ENDPOINT=seaweed,
            TENSORGATE_BACKEND_ACCESS_KEY="seaweed-ak",
            TENSORGATE_BACKEND_SECRET_KEY="seaweed-sk",
            # The development pair, configured: it is implied only for the embedded fs backend.
            TENSORGATE_ACCESS_KEY="tensorgate-dev",
            TENSORGATE_SECRET_KEY="tensorgate-dev-secret",
        )
    else:
        full.update(TENSORGATE_BACKEND_ROOT=str(tmp_path / "data"))
    full.update(env or {})
    log = open(tmp_path / f"gateway-{port}.log", "w")
    proc = subprocess.Popen([str(BINARY), "serve"], env=full, stdout=log, stderr=subprocess.STDOUT)
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        wait_ready(admin, proc)
        endpoint = f"http://127.0.0.1:{port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="tensorgate-dev",
            aws_secret_access_key="tensorgate-dev-secret",
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )
        yield endpoint, admin, client, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def direct_client(seaweed: str):
    """A boto3 client straight to SeaweedFS, bypassing the gateway (out-of-band writes)."""
    return boto3.client(
        "s3",
        endpoint_url=seaweed,
        aws_access_key_id="seaweed-ak",
        aws_secret_access_key="seaweed-sk",
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


def metric(admin: str, name: str) -> float:
    """Sum of a metric's samples whose line starts with `name` (labels included in `name` or not)."""
    with urllib.request.urlopen(f"{admin}/metrics") as r:
        text = r.read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(name))


@pytest.fixture(scope="session")
def seaweed() -> str:
    env = dict(os.environ, SEAWEED_PORT=str(SEAWEED_PORT))
    out = subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "start"], env=env, check=True, capture_output=True, text=True)
    yield out.stdout.strip()
    subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "stop"], env=env, check=False)


# The store the client tests run against (TENSORGATE_TEST_STORE: seaweedfs, ceph-rgw or swift):
# (script, port variable, port, access key, secret key, second user's access key and secret key),
# the scripts' defaults.
STORES = {
    "seaweedfs": ("seaweedfs.sh", "SEAWEED_PORT", SEAWEED_PORT, "seaweed-ak", "seaweed-sk", "seaweed-alt-ak", "seaweed-alt-sk"),
    "ceph-rgw": ("ceph-rgw.sh", "RGW_PORT", 19533, "rgw-ak", "rgw-sk", "rgw-alt-ak", "rgw-alt-sk"),
    "swift": ("swift.sh", "SWIFT_PORT", 19633, "test:tester", "testing", "test2:tester2", "testing2"),
    # The embedded backend: a local directory served in-process (no store process, no keys).
    "fs": (None, None, None, None, None, None, None),
}
STORE_KIND = os.environ.get("TENSORGATE_TEST_STORE", "seaweedfs")
# Who authenticates in the client tests (TENSORGATE_TEST_IDENTITY): "terminating", the gateway
# with its own client key; "transparent", the store, with the store's own user keys.
IDENTITY = os.environ.get("TENSORGATE_TEST_IDENTITY", "terminating")
TRANSPARENT = IDENTITY == "transparent"
# The keys the client tests sign with: the gateway's client key, or the store's user's own.
CLIENT_AK, CLIENT_SK = STORES[STORE_KIND][3:5] if TRANSPARENT else ("py-access-key", "py-secret-key")


@pytest.fixture(scope="session")
def store(request) -> dict:
    """The store behind the session's gateway: kind, endpoint and its own keys."""
    script, var, port, ak, sk, alt_ak, alt_sk = STORES[STORE_KIND]
    if STORE_KIND == "fs":
        endpoint = None
    elif STORE_KIND == "seaweedfs":
        endpoint = request.getfixturevalue("seaweed")
    else:
        env = dict(os.environ, **{var: str(port)})
        out = subprocess.run([str(ROOT / "scripts" / script), "start"], env=env, check=True, capture_output=True, text=True)
        endpoint = out.stdout.strip().splitlines()[-1]
    return {"kind": STORE_KIND, "endpoint": endpoint, "access_key": ak, "secret_key": sk, "alt_access_key": alt_ak,
            "alt_secret_key": alt_sk}


@pytest.fixture(scope="session")
def gateway(store, tmp_path_factory):
    """The tensorgate binary on free ports; yields (endpoint, admin, log path)."""
    port, admin_port = free_port(), free_port()
    gwdir = tmp_path_factory.mktemp("gw")
    log = gwdir / "gateway.log"
    config = gwdir / "tensorgate.toml"
    # Alias buckets are not buckets of the store: a request signed for one cannot reach the store
    # as signed, so transparent mode has none (ADR 0013).
    config.write_text(
        "" if TRANSPARENT else
        '[[pushdown.aliases]]\nbucket = "alias-tiny-pool"\ntarget = "alias-target"\nmodel = "tiny-cnn"\nsplit = "pool"\n'
        # Parquet datasets read through an alias by Parquet readers (test_s3_clients.py).
        '[[pushdown.aliases]]\nbucket = "alias-parquet"\ntarget = "alias-parquet-src"\nmodel = "tiny-cnn"\n'
        'split = "pool"\nformat = "parquet"\n'
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TENSORGATE_")}
    env.update(
        TENSORGATE_CONFIG=str(config),
        TENSORGATE_LISTEN=f"127.0.0.1:{port}",
        TENSORGATE_ADMIN_LISTEN=f"127.0.0.1:{admin_port}",
        TENSORGATE_LOG="debug",
        TENSORGATE_MODELS_DIR=str(ROOT / "models"),
        ORT_DYLIB_PATH=ort_library(),
    )
    if TRANSPARENT:
        # No client key, no store key: the store's users sign, the store decides.
        env.update(TENSORGATE_BACKEND_ENDPOINT=store["endpoint"], TENSORGATE_BACKEND_IDENTITY="transparent")
    elif store["endpoint"]:
        env.update(TENSORGATE_ACCESS_KEY=CLIENT_AK, TENSORGATE_SECRET_KEY=CLIENT_SK)
        env.update(
            TENSORGATE_BACKEND_ENDPOINT=store["endpoint"],
            TENSORGATE_BACKEND_ACCESS_KEY=store["access_key"],
            TENSORGATE_BACKEND_SECRET_KEY=store["secret_key"],
            TENSORGATE_BACKEND_TRAILING_CHECKSUMS=str(store["kind"] == "seaweedfs").lower(),
        )
    else:
        env.update(TENSORGATE_ACCESS_KEY=CLIENT_AK, TENSORGATE_SECRET_KEY=CLIENT_SK)
        env.update(TENSORGATE_BACKEND_ROOT=str(gwdir / "data"))
    with open(log, "w") as f:
        proc = subprocess.Popen([str(BINARY), "serve"], env=env, stdout=f, stderr=subprocess.STDOUT)
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        wait_ready(admin, proc)
        yield f"http://127.0.0.1:{port}", admin, log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture()
def client_env(gateway) -> dict:
    """Environment for CLI clients: the gateway's credentials, no inherited AWS settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=CLIENT_AK, AWS_SECRET_ACCESS_KEY=CLIENT_SK, AWS_DEFAULT_REGION="us-east-1")
    return env


@pytest.fixture()
def s3(gateway):
    endpoint, _, _ = gateway
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=CLIENT_AK,
        aws_secret_access_key=CLIENT_SK,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
    )


_counter = [0]


@pytest.fixture()
def bucket(s3) -> str:
    _counter[0] += 1
    name = f"py-{int(time.time() * 1000) % 10**9}-{_counter[0]}"
    s3.create_bucket(Bucket=name)
    return name
