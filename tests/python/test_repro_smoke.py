"""The reproduction harness (bench/repro) end to end on tiny data, on loopback (no network
namespaces, which CI may not allow): every mode runs, and the report is produced from the results."""

import json
import os
import subprocess
import sys

from conftest import BINARY, ROOT


def test_reproduction_harness_smoke(tmp_path):
    results = tmp_path / "smoke.jsonl"
    env = dict(os.environ, TENSORGATE_BIN=str(BINARY), TENSORGATE_CACHE_DIR=str(tmp_path / "graphs"))
    subprocess.run([sys.executable, str(ROOT / "bench/repro/run.py"), "--mode", "smoke", "--out", str(results)],
                   check=True, env=env, timeout=300)
    rows = [json.loads(l) for l in results.read_text().splitlines()]
    modes = {(r["mode"], r["overlap"]) for r in rows}
    assert {("images", True), ("tensors", True), ("split:stem", True), ("split:block2", True), ("auto", True),
            ("images", False), ("auto", False)} <= modes, modes
    for r in rows:
        assert not r.get("timeout") and r["epochs"][0] > 0 and r["bytes"] > 0, r
        assert r["storage_peak_rss"] > 0
    # Pushdown at the freeze split moves less than the raw image shards.
    by = {(r["mode"], r["overlap"]): r for r in rows}
    assert by[("split:block2", True)]["bytes"] < by[("images", True)]["bytes"]
    report = tmp_path / "REPRODUCTION.md"
    subprocess.run([sys.executable, str(ROOT / "bench/repro/report.py"), str(results), "--out", str(report)],
                   check=True, timeout=120, capture_output=True)
    text = report.read_text()
    assert "## (c) Split-choice quality" in text and "tiny-cnn" in text
    assert (tmp_path / "repro" / "epoch-vs-bandwidth-tiny-cnn.png").exists()
