"""The NIXL read probe (compose/entrypoint/vllm_serve/nixl_read_probe.py) run for real, as the
entrypoint's start check runs it, on this CPU machine (UCX over tcp)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.entrypoint.loader import PACKAGE

PROBE = PACKAGE / "nixl_read_probe.py"


@dataclass(frozen=True)
class ProbeRun:
    """What the probe left: its exit, its stdout and stderr, and UCX's output (the reading side's
    tables in ``ucx_log``; the side read from writes ``<log>.target``)."""

    returncode: int
    stdout: str
    stderr: str
    ucx_log: str
    log_path: Path


def run_probe(log: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The probe as a GPU server's start check runs it, with UCX limited to tcp (this machine)."""
    env = {**os.environ, "UCX_TLS": "tcp,self"}
    cmd = [sys.executable, str(PROBE), "--log", str(log), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
