"""Deployment files an operator copies are safe as written: the example configuration publishes no
working login, the compose file gives the gateway no store key and the admin port only to the host's
loopback, and secrets reach the gateway from files, never the command line that `ps` shows."""

import os
import re
import subprocess

import boto3
import botocore.exceptions
import pytest
import yaml
from botocore.config import Config

from conftest import BINARY, ROOT, free_port, ort_library, wait_ready

DOCS = [ROOT / "README.md", ROOT / "clients" / "python" / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


def test_the_compose_file_gives_the_gateway_no_store_key_and_no_admin_port_beyond_loopback():
    env = {**os.environ, "MINIO_ROOT_USER": "root-user-sentinel", "MINIO_ROOT_PASSWORD": "root-password-sentinel"}
    r = subprocess.run(["docker-compose", "-f", "docker/compose.yml", "config"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    services = yaml.safe_load(r.stdout)["services"]
    gateway = services["tensorgate"]
    environment = gateway.get("environment", {})
    assert not [k for k in environment if "KEY" in k or "SECRET" in k], environment
    assert "root-user-sentinel" not in str(gateway) and "root-password-sentinel" not in str(gateway)
    assert environment["TENSORGATE_BACKEND_IDENTITY"] == "transparent"
    for port in gateway["ports"]:
        text = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port['published']}:{port['target']}"
        if text.split(":")[-1].split("/")[0] == "9001":
            assert text.startswith("127.0.0.1:"), text
    assert "ports" not in services["minio"]  # the store is reached through the gateway only
    for s in services.values():
        image = s.get("image", "")
        assert ":" in image and not image.endswith(":latest"), image
    # It publishes no store credentials of its own: without the operator's, it does not render.
    bare = {k: v for k, v in os.environ.items() if not k.startswith("MINIO_")}
    r = subprocess.run(["docker-compose", "-f", "docker/compose.yml", "config", "-q"], cwd=ROOT, env=bare,
                       capture_output=True, text=True)
    assert r.returncode != 0 and "MINIO_ROOT_USER" in r.stderr, r.stderr


def test_no_documented_launch_puts_a_secret_on_the_command_line():
    inline = re.compile(r"--(backend-)?secret-key(?!-file)[ =](?!-)")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in DOCS
             for n, line in enumerate(p.read_text().splitlines(), 1) if inline.search(line)]
    assert found == []


def test_a_secret_from_a_file_signs_and_never_shows_in_ps(tmp_path):
    """The README's launch form: flags without a subcommand mean `serve`, the client secret comes
    from a file, and `ps` (the process's command line) shows its path, not the secret."""
    secret = "a-secret-of-my-own-7f3a"
    (tmp_path / "client-secret").write_text(secret + "\n")
    port, admin_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORGATE_", "ORT_"))}
    args = [str(BINARY), "--listen", f"127.0.0.1:{port}", "--admin-listen", f"127.0.0.1:{admin_port}",
            "--backend-root", str(tmp_path / "data"), "--models-dir", str(ROOT / "models"),
            "--ort-library", ort_library(), "--access-key", "own-client", "--secret-key-file",
            str(tmp_path / "client-secret")]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(f"http://127.0.0.1:{admin_port}", proc)
        cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read().decode()
        assert secret not in cmdline and "client-secret" in cmdline

        def client(ak, sk):
            return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", aws_access_key_id=ak,
                                aws_secret_access_key=sk, region_name="us-east-1",
                                config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))

        client("own-client", secret).create_bucket(Bucket="mine")
        assert "mine" in [b["Name"] for b in client("own-client", secret).list_buckets()["Buckets"]]
        # With a credential configured, the development pair no longer logs in.
        with pytest.raises(botocore.exceptions.ClientError) as e:
            client("tensorgate-dev", "tensorgate-dev-secret").list_buckets()
        assert e.value.response["Error"]["Code"] == "InvalidAccessKeyId"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("published", ["example-secret-key", "change-me-client-secret", "CLIENT_SECRET"])
def test_check_config_refuses_a_secret_the_documents_publish(tmp_path, published):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[[credentials]]\naccess_key = "k"\nsecret_key = "{published}"\n')
    r = subprocess.run([str(BINARY), "check-config", str(cfg)], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 64 and "credentials.secret_key" in r.stderr, r.stderr
    # The same key from a file is refused too.
    (tmp_path / "s").write_text(published)
    cfg.write_text(f'[[credentials]]\naccess_key = "k"\nsecret_key_file = "{tmp_path / "s"}"\n')
    r = subprocess.run([str(BINARY), "check-config", str(cfg)], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 64 and "publishes" in r.stderr, r.stderr


def test_the_example_config_copied_with_a_store_filled_in_publishes_no_login(tmp_path):
    """The operator's copy: the store's endpoint and key filled in, nothing else changed. Its
    commented example credential, uncommented, is refused."""
    text = (ROOT / "config" / "example.toml").read_text()
    assert "\n[[credentials]]" not in text and "\n[[pushdown.aliases]]" not in text
    (tmp_path / "store-secret").write_text("store-secret-of-my-own")
    copy = text.replace('# endpoint = "http://127.0.0.1:8333"', 'endpoint = "http://127.0.0.1:8333"') \
        .replace('kind = "fs"', 'kind = "s3"').replace('# access_key = "store-key"', 'access_key = "store-key"') \
        .replace('# secret_key_file = "/run/secrets/tensorgate-store"', f'secret_key_file = "{tmp_path / "store-secret"}"')
    env = {"PATH": "/usr/bin:/bin"}
    # As copied: the gateway would hold the store's key, and the file's only login is the published
    # development pair, which never acts with a store's key: refused, naming what is missing.
    (tmp_path / "copy.toml").write_text(copy)
    r = subprocess.run([str(BINARY), "check-config", str(tmp_path / "copy.toml")], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 64 and "`credentials`" in r.stderr and "development key" in r.stderr, r.stderr
    # With a client credential of the operator's own, it is a valid terminating gateway.
    (tmp_path / "client-secret").write_text("client-secret-of-my-own")
    own = copy.replace("# [[credentials]]\n# access_key = \"example-access-key\"",
                       f'[[credentials]]\naccess_key = "own"\nsecret_key_file = "{tmp_path / "client-secret"}"', 1)
    (tmp_path / "own.toml").write_text(own)
    r = subprocess.run([str(BINARY), "check-config", str(tmp_path / "own.toml")], capture_output=True, text=True,
                       env=env)
    assert r.returncode == 0, r.stderr
    uncommented = re.sub(r"(?m)^# (\[\[credentials\]\]|access_key = \"example-access-key\"|"
                         r"secret_key = \"example-secret-key\")$", r"\1", copy)
    assert uncommented.count('"example-secret-key"') == 1 and "\n[[credentials]]" in uncommented
    (tmp_path / "uncommented.toml").write_text(uncommented)
    r = subprocess.run([str(BINARY), "check-config", str(tmp_path / "uncommented.toml")], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 64 and "credentials.secret_key" in r.stderr, r.stderr


def test_the_readme_terminating_example_runs_as_written_with_no_secret_in_ps(tmp_path):
    """The README's terminating-mode launch, verbatim, in front of a SeaweedFS at the address it
    names: its secrets come from the files it names, a client signs with its key, and the gateway's
    command line (what `ps` shows) holds no secret."""
    section = (ROOT / "README.md").read_text().split("*Terminating* mode instead")[1]
    command = re.search(r"```sh\n(tensorgate serve.*?)\n```", section, re.S).group(1)
    assert "secret-key-file" in command
    env = dict(os.environ, SEAWEED_PORT="8333")
    subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "start"], env=env, check=True, capture_output=True)
    (tmp_path / "store.secret").write_text("seaweed-sk\n")
    (tmp_path / "client.secret").write_text("client-secret-of-my-own\n")
    run_env = {k: v for k, v in os.environ.items() if not k.startswith(("TENSORGATE_", "AWS_", "ORT_"))}
    run_env.update(PATH=f"{BINARY.parent}:{run_env['PATH']}", STORE_KEY="seaweed-ak", CLIENT_KEY="readme-client",
                   TENSORGATE_MODELS_DIR=str(ROOT / "models"), TENSORGATE_ORT_LIBRARY=ort_library())
    proc = subprocess.Popen(["bash", "-c", "exec " + command], cwd=tmp_path, env=run_env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        wait_ready("http://127.0.0.1:9001", proc)
        cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read().decode()
        assert "tensorgate" in cmdline and "seaweed-sk" not in cmdline and "client-secret-of-my-own" not in cmdline
        c = boto3.client("s3", endpoint_url="http://127.0.0.1:9000", aws_access_key_id="readme-client",
                         aws_secret_access_key="client-secret-of-my-own", region_name="us-east-1",
                         config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}))
        c.create_bucket(Bucket="readme-terminating")
        c.put_object(Bucket="readme-terminating", Key="k", Body=b"through the gateway")
        assert c.get_object(Bucket="readme-terminating", Key="k")["Body"].read() == b"through the gateway"
        c.delete_object(Bucket="readme-terminating", Key="k")
        c.delete_bucket(Bucket="readme-terminating")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        subprocess.run([str(ROOT / "scripts/seaweedfs.sh"), "stop"], env=env, check=False)
