"""compose/entrypoint/nixl_read_probe.py, run for real on this CPU machine: two processes, two NIXL
agents, one READ over UCX's tcp, the data checked. The H200 captures in data/ came from the same
script with --device cuda; here it proves the script still runs and that what it captures is
what the entrypoint's scanner reads (the KV pull's table, flagged as TCP when taken for a GPU
host)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.entrypoint.loader import entrypoint

ROOT = Path(__file__).resolve().parents[2]
PROBE = ROOT / "compose" / "entrypoint" / "nixl_read_probe.py"
kv = entrypoint()._sibling("kv_transport")


def run_probe(log: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "UCX_TLS": "tcp,self"}
    cmd = [sys.executable, str(PROBE), "--log", str(log), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)


def test_a_cpu_read_is_checked_and_its_table_is_the_one_the_scanner_reads(tmp_path) -> None:
    log = tmp_path / "ucx.txt"
    res = run_probe(log, "--device", "cpu", "--mib", "4", "--iters", "3")
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["checksum_ok"] is True and out["error"] == ""
    assert out["gb_per_s"] > 0 and out["ucx_env"]["UCX_PROTO_INFO"] == "y"
    scanner = kv.ProtoScanner()
    lines = log.read_text().splitlines()
    found = [t for line in lines for t in scanner.feed(line)] + list(scanner.close())
    (pull,) = [t for t in found if t.is_remote_read()]
    assert "probe-initiator" in pull.heading and "into host memory" in pull.heading
    assert pull.transports() == {"tcp"}
    assert "host memory" in (pull.problem_on_gpu() or "")  # on a GPU host this is the alarm
    assert (tmp_path / "ucx.txt.target").exists()  # the side read from keeps its own tables


def test_bad_sizes_are_refused() -> None:
    res = subprocess.run(
        [sys.executable, str(PROBE), "--log", "/dev/null", "--mib", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "--mib and --iters must be positive" in res.stderr
