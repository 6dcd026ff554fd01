"""Start, watch and stop the stack's processes, each in its own process group.

vLLM forks an engine-core process; stopping only the API server's PID would orphan it. Every
process therefore runs in a new session and is stopped with killpg (TERM, then KILL after a
grace period). Waiting for health fails fast, with the log tail, when the process dies.

A launcher killed without running its cleanup (SIGKILL, or SIGTERM with Python's default
handling) would leave those sessions running; on Linux each child therefore also asks the kernel
for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG). SIGTERM, not SIGKILL, so vLLM's API
server still stops its own engine-core process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from pcp_pd_kit.localstack.commands import ProcessSpec

log = logging.getLogger("pcp_pd_kit.localstack")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def parent_death_preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A Popen preexec_fn making the child receive sig when its parent dies; None off Linux.

    The kernel sends it when the thread that forked the child exits, so start children from a
    long-lived thread (the launcher and pytest use the main thread).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not after fork
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


class StackProcessError(RuntimeError):
    """A stack process died or never became healthy; the message names it and shows its log."""


def log_tail(path: Path, lines: int = 30) -> str:
    """The last lines of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class ManagedProcess:
    """One child process with its log file; start() launches, stop() ends its whole group."""

    def __init__(self, spec: ProcessSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name}.log"
        self.popen: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.healthy_after_s: float | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        if "PYTHONPATH" in self.spec.env and os.environ.get("PYTHONPATH"):
            extra = os.environ["PYTHONPATH"]
            env["PYTHONPATH"] = f"{self.spec.env['PYTHONPATH']}{os.pathsep}{extra}"
        with open(self.log_path, "ab") as logfile:
            logfile.write(f"\n=== start {' '.join(self.spec.argv)}\n".encode())
            logfile.flush()
            try:
                self.popen = subprocess.Popen(
                    self.spec.argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=logfile,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=parent_death_preexec(),
                )
            except FileNotFoundError as exc:
                raise StackProcessError(
                    f"{self.name}: cannot run {self.spec.argv[0]}: {exc}"
                ) from exc
        self.started_at = time.monotonic()
        self.healthy_after_s = None
        log.info("started %s (pid %d), log %s", self.name, self.popen.pid, self.log_path)

    def is_running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def died_error(self) -> StackProcessError:
        code = self.popen.returncode if self.popen else None
        return StackProcessError(
            f"{self.name} exited with code {code}; last lines of {self.log_path}:\n"
            f"{log_tail(self.log_path)}"
        )

    def is_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.spec.health_url, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self, grace_s: float = 20.0) -> None:
        """TERM the process group, KILL it after grace_s; safe to call twice."""
        if self.popen is None:
            return
        pgid = self.popen.pid  # start_new_session: the group id is the leader's pid
        if self.popen.poll() is None:
            signal_group(pgid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                log.warning("%s ignored SIGTERM for %.0fs, killing", self.name, grace_s)
        # The leader may be gone while children (vLLM's engine core) linger: KILL the group.
        signal_group(pgid, signal.SIGKILL)
        try:
            self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not exit after SIGKILL", self.name, pgid)
        log.info("stopped %s (pid %d)", self.name, pgid)
        self.popen = None


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal a whole process group; a group that is already gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_healthy(
    processes: Sequence[ManagedProcess], timeout_s: float, progress_every_s: float = 10.0
) -> None:
    """Poll every process's health URL until all answer 200; log progress while waiting.

    Raises StackProcessError at once when one dies, or naming the laggards after timeout_s.
    """
    pending = list(processes)
    start = time.monotonic()
    last_report = start
    while pending:
        for proc in list(pending):
            if not proc.is_running():
                raise proc.died_error()
            if proc.is_healthy():
                proc.healthy_after_s = time.monotonic() - proc.started_at
                log.info("%s healthy after %.1fs", proc.name, proc.healthy_after_s)
                pending.remove(proc)
        if not pending:
            return
        now = time.monotonic()
        if now - start > timeout_s:
            names = ", ".join(p.name for p in pending)
            tails = "\n".join(
                f"--- {p.name} ({p.log_path}):\n{log_tail(p.log_path, 15)}" for p in pending
            )
            raise StackProcessError(
                f"not healthy after {timeout_s:.0f}s: {names} "
                f"(LOCAL_STARTUP_TIMEOUT_S raises the limit)\n{tails}"
            )
        if now - last_report >= progress_every_s:
            last_report = now
            log.info(
                "waiting for %s to become healthy: %.0fs / %.0fs",
                ", ".join(p.name for p in pending),
                now - start,
                timeout_s,
            )
        time.sleep(0.5)
