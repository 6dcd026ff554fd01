"""Start helper processes for tests and always stop them (by PID), even when a test fails."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited {proc.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not up after {timeout}s:\n{log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM to the process group (its children too), SIGKILL after ``grace_s``; waits for it."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextlib.contextmanager
def running(
    argv: list[str], log: Path, ready_url: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """Run ``argv`` in its own process group until the block ends; wait for ``ready_url``."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        wait_http(ready_url, proc, log)
        yield proc
    finally:
        stop(proc)
